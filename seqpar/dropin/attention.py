"""Selective activation recomputation for drop-in models (paper §5, "selective").

Only the attention core (QK^T, softmax, softmax dropout, attention over V) is recomputed in
backward; the q / k / v / output projections, norms and MLPs keep their activations. For a
Hugging Face model the core is the function its attention modules call through
``transformers``' ``AttentionInterface``: :func:`checkpoint_attention` switches the model to a
wrapper of its current implementation (``eager`` or ``sdpa``), so no module or library function
is modified. Each wrapper is registered once per process under a fixed name
(``seqpar_selective_eager``, ``seqpar_selective_sdpa``) and finds a model's RNG streams on the
calling attention module, so any number of models share the two names. The wrapper runs the core
under :func:`seqpar.recompute.checkpoint`, which keeps only q, k, v and replays the RNG state,
so the recomputed dropout masks are the forward pass's.

:func:`use_streams` (called by ``parallelize``) switches a model to the same wrapper without the
recomputation (``seqpar_streams_eager`` / ``seqpar_streams_sdpa``): the attention dropout of the
modules given the model's streams then draws from their per-TP-rank ``"tp"`` stream.
"""
from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.nn as nn

from ..distributed.rng import RNGStreams
from ..model import GPT
from ..recompute import checkpoint, recompute_region
from .wrappers import unwrap

PREFIX = "seqpar_selective"
STREAMS_PREFIX = "seqpar_streams"  # the wrapper without recomputation (use_streams)
IMPLS = ("eager", "sdpa")
STREAMS_ATTR = "_seqpar_attention_streams"  # the streams an attention module draws from (None: torch's)


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


def _check_lengths(module: nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None) -> None:
    """q ``[b, heads, q_len, d]`` may be shorter than k (a KV cache), never longer; a mask covers
    exactly q's positions. Anything else means q, k or the mask came through different sequence
    shards (layers built over another group than the one their input was split over)."""
    q_len, k_len = query.shape[-2], key.shape[-2]
    mask_q = mask.shape[-2] if isinstance(mask, torch.Tensor) and mask.dim() == 4 else q_len
    if q_len > k_len or mask_q not in (1, q_len):
        raise ValueError(f"checkpoint_attention: {type(module).__name__} got query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)} and mask {None if mask is None else tuple(mask.shape)}: their "
                         f"sequence lengths disagree, so one of them holds a sequence shard; check that every "
                         f"seqpar layer uses the TP group the hidden states were split over "
                         f"(seqpar.dropin.check_groups(model, mesh))")


def _selective(impl: str, recompute: bool = True) -> Callable:
    """The wrapper of implementation ``impl``, recomputing the core in backward or not; dropout
    draws from the calling module's streams (``STREAMS_ATTR``), or torch's default generator
    where there are none."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        _check_lengths(module, query, key, attention_mask)
        base = _base_attention(module, impl)
        streams: RNGStreams | None = getattr(module, STREAMS_ATTR, None)

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if streams is None:
                return base(module, q, k, v, attention_mask, **kwargs)[0]
            with streams.fork("tp"):  # this rank's heads draw their own masks
                return base(module, q, k, v, attention_mask, **kwargs)[0]

        draws = streams is not None and module.training and kwargs.get("dropout", 0.0) > 0
        if torch.compiler.is_compiling() and not draws:  # a policy region: the RNG capture is not traceable
            fn = (lambda q, k, v: base(module, q, k, v, attention_mask, **kwargs)[0])
            return (recompute_region(fn, query, key, value) if recompute else fn(query, key, value)), None
        # attention probabilities are exactly what is not kept: none are returned
        return _core_outside_graph()(core, query, key, value, recompute, streams), None

    attention.__qualname__ = f"{PREFIX if recompute else STREAMS_PREFIX}_{impl}"
    return attention


def _eager_core(core: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recompute: bool,
                streams: RNGStreams | None) -> torch.Tensor:
    """``core(q, k, v)``, checkpointed (``streams`` replayed in backward) when ``recompute``. Under
    torch.compile it runs eagerly between two graphs: attention dropout drawn from seqpar streams
    costs a graph break per attention call (``fullgraph=True`` refuses it)."""
    return checkpoint(core, q, k, v, streams=streams) if recompute else core(q, k, v)


_OUTSIDE_GRAPH: list[Callable] = []  # [_eager_core under torch.compiler.disable], made at first use


def _core_outside_graph() -> Callable:
    """:func:`_eager_core` under ``torch.compiler.disable`` (swapping a stream into the default
    generator is not traceable, so it runs outside the graph). Made at first use, not at import:
    ``torch.compiler.disable`` imports dynamo, about a second that ``import seqpar`` need not pay."""
    if not _OUTSIDE_GRAPH:
        _OUTSIDE_GRAPH.append(torch.compiler.disable(_eager_core))
    return _OUTSIDE_GRAPH[0]


_WRAPPERS = {impl: _selective(impl) for impl in IMPLS}
_STREAM_WRAPPERS = {impl: _selective(impl, recompute=False) for impl in IMPLS}


def _registered(impl: str, recompute: bool = True) -> str:
    """The name of ``impl``'s wrapper in ``transformers``' attention and mask registries,
    registering it on first use (the mask function is ``impl``'s own)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _core_outside_graph()  # made before any compiled call can trace a wrapper
    name, wrapper = (f"{PREFIX}_{impl}", _WRAPPERS[impl]) if recompute else \
        (f"{STREAMS_PREFIX}_{impl}", _STREAM_WRAPPERS[impl])
    if ALL_ATTENTION_FUNCTIONS.get(name) is not wrapper:
        AttentionInterface.register(name, wrapper)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def _base_impl(impl: str) -> str:
    """The ``transformers`` implementation under one of seqpar's wrapper names (``impl`` itself
    when it is none of them)."""
    for prefix in (PREFIX, STREAMS_PREFIX):
        if impl.startswith(prefix + "_"):
            return impl[len(prefix) + 1:]
    return impl


def use_streams(model: nn.Module, modules: list[nn.Module], streams: RNGStreams) -> bool:
    """Draw the attention dropout of ``modules`` (attention modules of ``model`` running this rank's
    heads) from ``streams``' ``"tp"`` stream, switching a ``transformers`` model on the ``eager``
    or ``sdpa`` implementation to seqpar's wrapper of it (no recomputation; a model already on
    :func:`checkpoint_attention`'s keeps it). False when the model has no such implementation:
    its attention dropout then draws as the implementation does."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or impl is None or _base_impl(impl) not in IMPLS:
        return False
    for module in modules:
        setattr(module, STREAMS_ATTR, streams)
    if impl in IMPLS:
        _own_config(model)
        model.set_attn_implementation(_registered(impl, recompute=False))
    return True


def checkpoint_attention(model: nn.Module, *, streams: RNGStreams | None = None) -> nn.Module:
    """Recompute ``model``'s attention core in backward instead of keeping it; returns ``model``.

    ``model``: a ``transformers`` model using the ``eager`` or ``sdpa`` attention implementation
    (e.g. ``GPT2LMHeadModel``, ``LlamaForCausalLM``), or seqpar's own ``GPT`` (switched to
    ``recompute="selective"``; it owns its streams). ``streams``: seqpar RNG streams whose
    per-TP-rank ``"tp"`` stream the attention dropout draws from; by default those
    ``seqpar.parallelize`` gave the model (``model.seqpar.streams``), or torch's default generator
    for a model it did not parallelize. Calling it again on the same model only replaces the
    streams. Attention weights are no longer returned (``output_attentions`` yields ``None``).
    """
    outer, model = model, unwrap(model)  # the module inside torch.compile / DDP wrappers
    if isinstance(model, GPT):
        model.set_recompute("selective")
        return outer
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if not hasattr(model, "set_attn_implementation") or impl is None:
        raise ValueError(f"checkpoint_attention: {type(model).__name__} is neither seqpar's GPT nor a transformers "
                         f"model with a selectable attention implementation")
    base = _base_impl(impl)
    if base not in IMPLS:
        raise ValueError(f"checkpoint_attention: supports the 'eager' and 'sdpa' attention implementations, "
                         f"the model uses {impl!r}")
    if streams is not None or getattr(getattr(model, "seqpar", None), "streams", None) is None:
        for module in model.modules():  # the attention modules among them read it when called
            setattr(module, STREAMS_ATTR, streams)
    if impl.startswith(PREFIX + "_"):
        return outer
    if impl == base:  # a model on use_streams' wrapper already has a config of its own
        _own_config(model)
    model.set_attn_implementation(_registered(base))
    return outer


def _own_config(model) -> None:
    """Give ``model`` (and each submodule sharing it) a copy of its config, so switching the
    attention implementation leaves the caller's config object as it was."""
    import copy
    original = model.config
    mine = copy.deepcopy(original)
    for module in model.modules():
        if getattr(module, "config", None) is original:
            module.config = mine


__all__ = ["checkpoint_attention", "use_streams"]
