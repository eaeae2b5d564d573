"""MLP: fc1 (column-parallel) -> GeLU -> fc2 (row-parallel)."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..layers import ColumnParallelLinear, RowParallelLinear
from .config import GPTConfig


class MLP(nn.Module):
    """``[s/t, b, h]`` (SP) or ``[s, b, h]`` -> same shape, through ``[s, b, ffn/t]`` on each rank."""

    def __init__(self, config: GPTConfig, tp_group, layer_std: tuple[float, float]):
        super().__init__()
        h, f, dt, sp = config.hidden, config.ffn_hidden, config.torch_dtype, config.sequence_parallel
        std, out_std = layer_std
        self.fc1 = ColumnParallelLinear(h, f, bias=config.bias, tp_group=tp_group, sequence_parallel=sp, dtype=dt,
                                        init_method=lambda w: nn.init.normal_(w, 0.0, std))
        # a module of its own so the memory ledger can name what it keeps (its input, 8sbh/t in bf16)
        self.act = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.fc2 = RowParallelLinear(f, h, bias=config.bias, tp_group=tp_group, sequence_parallel=sp, dtype=dt,
                                     init_method=lambda w: nn.init.normal_(w, 0.0, out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
