"""MLP: fc1 (column-parallel) -> GeLU -> fc2 (row-parallel), or the SwiGLU form
``fc2(silu(gate) * up)`` with ``[gate; up]`` fused in fc1 (2 chunks, split over TP separately)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import ColumnParallelLinear, RowParallelLinear
from .recompute_ops import recompute_output
from .config import GPTConfig


class _SwiGLUFn(torch.autograd.Function):
    """``[..., 2f/t] = [gate | up]`` -> ``silu(gate) * up``, ``[..., f/t]``.

    Keeps only its input (gate and up, one buffer: ``4sbf/t`` bytes in bf16) and recomputes
    ``sigmoid(gate)`` in backward; the unfused form would also keep ``silu(gate)``.
    """

    @staticmethod
    def forward(ctx, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        ctx.save_for_backward(gate_up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors[0].chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        grad_gate = grad * up * sig * (1 + gate * (1 - sig))  # d silu / d gate = sig (1 + gate (1 - sig))
        return torch.cat([grad_gate, grad * silu], dim=-1)


class SwiGLU(nn.Module):
    """``silu(gate) * up`` on the fused fc1 output ``[s, b, 2f/t]`` -> ``[s, b, f/t]``."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return _SwiGLUFn.apply(gate_up)


class MLP(nn.Module):
    """``[s/t, b, h]`` (SP) or ``[s, b, h]`` -> same shape, through ``[s, b, f/t]`` on each rank.

    ``mlp="gelu"``: fc1 ``[f, h]``, GeLU, fc2 ``[h, f]``. ``mlp="swiglu"``: fc1 ``[2f, h]`` holding
    ``[gate; up]`` (rank ``r`` computes ``[gate_r | up_r]``), :class:`SwiGLU`, fc2 ``[h, f]``.
    """

    def __init__(self, config: GPTConfig, tp_group, layer_std: tuple[float, float]):
        super().__init__()
        h, f, dt, sp = config.hidden, config.ffn_hidden, config.torch_dtype, config.sequence_parallel
        std, out_std = layer_std
        swiglu = config.mlp == "swiglu"
        self.fc1 = ColumnParallelLinear(h, 2 * f if swiglu else f, bias=config.bias, tp_group=tp_group,
                                        sequence_parallel=sp, dtype=dt, chunks=2 if swiglu else 1,
                                        init_method=lambda w: nn.init.normal_(w, 0.0, std))
        # a module of its own so the memory ledger can name what it keeps (its input)
        self.act = SwiGLU() if swiglu else nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.fc2 = RowParallelLinear(f, h, bias=config.bias, tp_group=tp_group, sequence_parallel=sp, dtype=dt,
                                     init_method=lambda w: nn.init.normal_(w, 0.0, out_std))
        # model.recompute_ops: [activation]: fc2's input rebuilt from fc1's output (which act keeps) in backward
        self.recompute_activation = "activation" in config.recompute_ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute_activation:
            return recompute_output(self.act, self.fc1(x), self.fc2)
        return self.fc2(self.act(self.fc1(x)))
