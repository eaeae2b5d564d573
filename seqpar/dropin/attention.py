"""Selective activation recomputation for drop-in models (paper §5, "selective").

Only the attention core (QK^T, softmax, softmax dropout, attention over V) is recomputed in
backward; the q / k / v / output projections, norms and MLPs keep their activations. For a
Hugging Face model the core is the function its attention modules call through
``transformers``' ``AttentionInterface``: :func:`checkpoint_attention` registers a wrapper of the
model's current implementation (``eager`` or ``sdpa``) under a new name and switches the model to
it, so no module or library function is modified. The wrapper runs the core under
:func:`seqpar.recompute.checkpoint`, which keeps only q, k, v and replays the RNG state, so the
recomputed dropout masks are the forward pass's.
"""
from __future__ import annotations

import itertools
import sys
from typing import Callable

import torch
import torch.nn as nn

from .distributed.rng import RNGStreams

PREFIX = "seqpar_selective"
_counter = itertools.count()


def _base_attention(module: nn.Module, impl: str) -> Callable:
    """The attention function ``module`` would call under implementation ``impl``."""
    if impl == "eager":
        if getattr(module, "reorder_and_upcast_attn", False):  # GPT-2's fp32 eager variant
            return lambda m, q, k, v, mask, dropout=0.0, scaling=None, **kw: m._upcast_and_reordered_attn(q, k, v, mask)
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise ValueError(f"checkpoint_attention: {type(module).__name__} has no eager_attention_forward")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def _selective(impl: str, streams: RNGStreams | None) -> Callable:
    from .recompute import checkpoint  # here, not at import: seqpar.recompute re-exports this module

    def attention(module, query, key, value, attention_mask, **kwargs):
        base = _base_attention(module, impl)

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if streams is None:
                return base(module, q, k, v, attention_mask, **kwargs)[0]
            with streams.fork("tp"):  # this rank's heads draw their own masks
                return base(module, q, k, v, attention_mask, **kwargs)[0]

        # attention probabilities are exactly what is not kept: none are returned
        return checkpoint(core, query, key, value, streams=streams), None

    return attention


def checkpoint_attention(model: nn.Module, *, streams: RNGStreams | None = None) -> nn.Module:
    """Recompute ``model``'s attention core in backward instead of keeping it; returns ``model``.

    ``model``: a ``transformers`` model using the ``eager`` or ``sdpa`` attention implementation
    (e.g. ``GPT2LMHeadModel``, ``LlamaForCausalLM``), or seqpar's own ``GPT`` (switched to
    ``recompute="selective"``). ``streams``: optional seqpar RNG streams; attention dropout then
    draws from their per-TP-rank ``"tp"`` stream instead of torch's default generator. Attention
    weights are no longer returned (``output_attentions`` yields ``None``).
    """
    from .model import GPT

    if isinstance(model, GPT):
        model.set_recompute("selective")
        return model
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or impl is None:
        raise ValueError(f"checkpoint_attention: {type(model).__name__} is neither seqpar's GPT nor a transformers "
                         f"model with a selectable attention implementation")
    if impl.startswith(PREFIX):
        return model
    if impl not in ("eager", "sdpa"):
        raise ValueError(f"checkpoint_attention: supports the 'eager' and 'sdpa' attention implementations, "
                         f"the model uses {impl!r}")
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = f"{PREFIX}_{impl}_{next(_counter)}"
    AttentionInterface.register(name, _selective(impl, streams))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])  # same masks as before
    model.set_attn_implementation(name)
    return model


__all__ = ["checkpoint_attention"]
