"""Bytes backward needs beyond what the layers keep: the transient of the layer being differentiated.

While one layer runs backward, its activation gradients exist next to everything the other layers
keep: at most what the layer keeps without recomputation, for one micro-batch (``per_layer["none"]``,
:func:`seqpar.memory.whole_model.layer_bytes`). Recomputation adds what it rebuilds while it runs:
under full recompute a checkpointed unit's activations again (``unit_layers`` layers of
``per_layer["none"]``), under selective the attention terms selective dropped (``none - selective``).
Under context parallelism the attention kernel works on one ``[c, c]`` block of the sequence at a
time (``c = s / 2cp``): its fp32 scores, probabilities and their gradient for ``a/t`` heads.
"""
from __future__ import annotations

from typing import Mapping


def backward_transient_bytes(per_layer: Mapping[str, float], *, unit_layers: int = 0,
                             selective: bool = False) -> float:
    """Bytes of one layer's backward for one micro-batch beyond the kept activations.
    ``per_layer``: bytes one layer keeps per recompute mode (``"none"``, ``"selective"``);
    ``unit_layers``: layers of the checkpointed unit full recompute rebuilds (0: none rebuilt);
    ``selective``: the attention core is recomputed (counted only when no full unit is)."""
    working = per_layer["none"]  # the activation gradients of the layer in backward
    if unit_layers:
        working += unit_layers * per_layer["none"]
    elif selective:
        working += per_layer["none"] - per_layer["selective"]
    return working


def context_block_bytes(*, heads: int, seq_len: int, micro_batch: int, t: int, cp: int, attention: str = "math",
                        cp_comm: str = "ring", kv_heads: int = 0, head_dim: int = 0) -> int:
    """Backward transient of the context-parallel kernel for a TP rank's ``heads / t`` heads, with
    ``c = seq_len / 2cp``: one ``[c, c]`` block's fp32 scores, probabilities and their gradient,
    ``3 x 4 x b x (a/t) x c^2`` (``attention: math``), or under ``sdpa``'s fused kernels (which never
    hold a block's scores) the block's K/V repeated to ``a/t`` heads and their gradients,
    ``4 x 4 x b x (a/t) x c x d``; with the all-gather exchange also the whole sequence's K/V
    (``kv_heads`` held per rank), their gradients and the copies that reorder them, about four fp32
    ``[s, 2, b, g/t, d]`` tensors (the ring holds one block of K/V at a time). 0 without cp."""
    if cp == 1:
        return 0
    c, local = seq_len // (2 * cp), heads // t
    block = 3 * 4 * micro_batch * local * c * c if attention == "math" else 4 * 4 * micro_batch * local * c * head_dim
    if cp_comm == "ring":
        return block
    kv = 2 * seq_len * micro_batch * kv_heads * head_dim
    return block + 4 * 4 * kv


__all__ = ["backward_transient_bytes", "context_block_bytes"]
