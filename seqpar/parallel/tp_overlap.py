"""Overlapped TP communication, applied from outside the model (``parallel.tp_overlap: true``).

Turns on ``tp_overlap`` in every sequence-parallel column- and row-parallel layer of a TP group of
more than one rank: SP's all-gather and reduce-scatter then run as per-rank chunks under the GEMMs
(:mod:`seqpar.layers.overlap`). Applied right after the model is built with TP/SP, before
recompute, compile and data parallelism wrap it; it changes no parameter, result or saved tensor.
"""
from __future__ import annotations

import torch.nn as nn

from ..layers import ColumnParallelLinear, RowParallelLinear


def apply_tp_overlap(model: nn.Module, enabled: bool = True) -> int:
    """Set ``tp_overlap`` to ``enabled`` on ``model``'s sequence-parallel TP layers (``t > 1``);
    return how many layers it set. Layers without sequence parallelism are left as they are."""
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
              and m.sequence_parallel and m.tp_size > 1]
    for m in layers:
        m.tp_overlap = enabled
    return len(layers)
