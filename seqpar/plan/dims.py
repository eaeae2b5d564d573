"""What the planner reads from a ``GPTConfig`` beyond the byte and FLOP formulas: a hashable key
for its caches and the config as a layout runs it. Widths and parameter counts are
:mod:`seqpar.memory.params`; FLOPs are :mod:`seqpar.flops`.
"""
from __future__ import annotations

from dataclasses import replace

from ..model.config import GPTConfig


def with_sequence_parallel(model: GPTConfig, sequence_parallel: bool) -> GPTConfig:
    """``model`` with the layout's sequence parallelism (the formulas read it from the config)."""
    if model.sequence_parallel == sequence_parallel:
        return model
    return replace(model, sequence_parallel=sequence_parallel)


def model_key(model: GPTConfig) -> tuple:
    """The fields the planner reads, as a hashable key for its caches."""
    return (model.seq_len, model.hidden, model.heads, model.ffn_hidden, model.layers, model.vocab_size,
            model.vocab_multiple, model.dropout, model.attention_dropout, model.bias, model.tie_embeddings,
            model.num_kv_heads, model.mlp, model.position, model.norm, model.attention, tuple(model.recompute_ops))


def with_recompute_ops(model: GPTConfig, ops: tuple[str, ...]) -> GPTConfig:
    """``model`` with a layout's ``model.recompute_ops`` (``()``: the model's own)."""
    if not ops or tuple(model.recompute_ops) == tuple(ops):
        return model
    return replace(model, recompute_ops=tuple(ops))
