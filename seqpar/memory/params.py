"""Parameters one GPU holds, counted from a ``GPTConfig`` (GPT-2 and Llama families alike).

Per TP rank: each layer's QKV (``h + 2gd`` columns with ``g`` key/value heads of dim ``d``),
projection and MLP matrices split ``t`` ways (SwiGLU's fc1 is the fused gate and up, ``2f``
columns), their column biases too; norms and row biases whole. The token embedding's rows are the
vocabulary padded for ``t`` (:meth:`GPTConfig.padded_vocab`), split ``t`` ways, on the first
stage with the learned position table (whole); the final norm, and an output matrix of the same
size where it is not tied to the embedding (or with ``p > 1``), on the last stage.
"""
from __future__ import annotations

from ..model.config import GPTConfig


def qkv_width(model: GPTConfig, t: int = 1) -> int:
    """Output columns of the fused QKV projection, all ``t`` TP ranks together: h + 2 g d, with
    g the key/value heads they hold (:meth:`GPTConfig.held_kv_heads`: t when g < t)."""
    return model.hidden + 2 * model.held_kv_heads(t) * model.head_dim


def fc1_width(model: GPTConfig) -> int:
    """Output columns of the first MLP projection: 2f for SwiGLU (gate and up), else f."""
    return (2 if model.mlp == "swiglu" else 1) * model.ffn_hidden


def norm_params(model: GPTConfig) -> int:
    """Parameters of one normalisation layer: weight, plus bias for a biased LayerNorm."""
    return model.hidden * (2 if (model.norm == "layernorm" and model.bias) else 1)


def layer_params(model: GPTConfig, t: int, *, layer: int = 0, ep: int = 1) -> int:
    """Parameters of transformer layer ``layer`` held by one TP rank (of ``ep`` expert-parallel
    ranks): an MoE layer holds, instead of the MLP, the router ``E h`` (with the sigmoid router's
    bias ``E``), its ``E/ep`` experts whole (replicated over TP) and the shared experts split ``t`` ways."""
    return _kind_params(model, t, model.moe is not None and model.moe.is_moe_layer(layer), ep)


def _kind_params(model: GPTConfig, t: int, moe: bool, ep: int) -> int:
    """:func:`layer_params` of a dense (``moe`` False) or an MoE layer."""
    h, f = model.hidden, model.ffn_hidden
    qkv, fc1 = qkv_width(model, t), fc1_width(model)
    mlp = 0 if moe else h * fc1 + f * h
    weights = (h * qkv + h * h + mlp) // t
    biases = (qkv + (0 if moe else fc1)) // t + (1 if moe else 2) * h if model.bias else 0  # column split, row whole
    norms = 2 * norm_params(model) + (2 * model.head_dim if model.qk_norm else 0)
    return weights + biases + norms + (moe_ffn_params(model, t, ep) if moe else 0)


def moe_layers_in(model: GPTConfig, begin: int, end: int) -> int:
    """How many of layers ``begin ... end - 1`` have an MoE FFN (0 for a dense model)."""
    if model.moe is None:
        return 0
    return model.moe.moe_layer_count(end) - model.moe.moe_layer_count(begin)


def moe_ffn_params(model: GPTConfig, t: int, ep: int = 1) -> int:
    """Parameters of one MoE FFN on one rank: router, this ep rank's experts, shared experts."""
    moe, h = model.moe, model.hidden
    f = moe.expert_ffn(model.ffn_hidden)
    gated = 2 if model.mlp == "swiglu" else 1
    router = moe.experts * h + (moe.experts if moe.router == "sigmoid" else 0)
    experts = moe.experts // ep * (gated + 1) * f * h // (t if moe.expert_tp else 1)  # expert-TP: f/t each
    shared = moe.shared_experts * f * (gated + 1) * h // t
    return router + experts + shared


def expert_params(model: GPTConfig, t: int, *, pp: int = 1, stage: int = 0, ep: int = 1) -> int:
    """Parameters of the routed experts held by one GPU of pipeline stage ``stage`` (part of
    :func:`stage_params`): ``E/ep`` experts of ``(gated + 1) f h`` each per MoE layer (``/t`` under
    expert-TP); the ones reduced, and sharded under FSDP2, over the expert-data-parallel ranks."""
    moe = model.moe
    if moe is None:
        return 0
    per = model.layers // pp
    layers = moe_layers_in(model, stage * per, (stage + 1) * per)
    gated = 2 if model.mlp == "swiglu" else 1
    f = moe.expert_ffn(model.ffn_hidden)
    return layers * (moe.experts // ep * (gated + 1) * f * model.hidden // (t if moe.expert_tp else 1))


def root_params(model: GPTConfig, t: int, *, first: bool = True, last: bool = True, pp: int = 1) -> int:
    """Parameters outside the layers on one TP rank of a stage holding the ``first`` and / or
    ``last`` ends of the model: embedding (+ positions), final norm, untied output matrix."""
    vocab = model.padded_vocab(t) * model.hidden // t
    n = 0
    if first:
        n += vocab + (model.seq_len * model.hidden if model.position == "learned" else 0)
    if last:
        n += norm_params(model) + (vocab if (pp > 1 or not model.tie_embeddings) else 0)
    return n


def stage_params(model: GPTConfig, *, t: int, pp: int = 1, stage: int = 0, ep: int = 1) -> int:
    """Parameters held by one GPU of pipeline stage ``stage`` (0 = first) of ``pp``, before any
    dp sharding: its ``L/pp`` layers plus the ends of the model it holds."""
    per = model.layers // pp
    n_moe = moe_layers_in(model, stage * per, (stage + 1) * per)
    layers = (per - n_moe) * _kind_params(model, t, False, ep)
    layers += n_moe * _kind_params(model, t, True, ep) if n_moe else 0
    return layers + root_params(model, t, first=stage == 0, last=stage == pp - 1, pp=pp)


__all__ = ["expert_params", "fc1_width", "layer_params", "moe_ffn_params", "moe_layers_in", "norm_params", "qkv_width",
           "root_params", "stage_params"]
