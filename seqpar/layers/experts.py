"""Experts as one grouped GEMM, and the token permutation around it (no Python loop over tokens).

Tokens are routed as ``n`` rows ``[n, h]`` with ``k`` expert ids each. :func:`sort_by_expert`
orders the ``n*k`` assignments by expert (stable: by token, then slot, within an expert);
:func:`permute` gathers the rows in that order, :class:`GroupedExperts` runs each expert on its
contiguous group of rows, and :func:`unpermute` puts the rows back and sums each token's ``k``
outputs weighted by its routing weights.

The grouped GEMM is ``torch._grouped_mm`` (one kernel over all groups, group offsets on the
device: no host sync) where the device and dtype allow it -- bf16 on CUDA, fp32/bf16 on the CPU,
with 16-byte aligned rows -- and a loop over the experts (``torch.split`` by the host's counts)
elsewhere, fp64 included. Both give the same numbers (tests/test_moe.py).
"""
from __future__ import annotations

from typing import Callable, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.layouts import REPLICATED, SP_REPLICATED, ParamLayout

Kernel = Literal["auto", "grouped_mm", "loop"]


def sort_by_expert(expert_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``expert_ids [n, k]`` -> (``order [n*k]``: assignment indices sorted by expert, stable;
    ``counts [E]``: assignments per expert). Assignment ``a`` is token ``a // k``, slot ``a % k``."""
    flat = expert_ids.reshape(-1)
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=experts)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv


def permute(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """``x [n, h]`` -> ``[n*k, h]``: row ``i`` is the token of assignment ``order[i]``."""
    return x.index_select(0, torch.div(order, k, rounding_mode="floor"))


def unpermute(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``y [n*k, h]`` (expert outputs in ``order``) -> ``[n, h]``: each token's ``k`` outputs
    times ``weights [n, k]``, summed in slot order (the same sum whatever the layout)."""
    n, k = weights.shape
    back = y.index_select(0, inverse_permutation(order)).view(n, k, -1)  # [n, k, h], assignment order
    return (back * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def grouped_mm_supported(device_type: str, dtype: torch.dtype, out_features: int, in_features: int) -> bool:
    """Whether ``torch._grouped_mm`` runs rows of ``dtype`` on ``device_type`` against experts
    ``[E, out, in]``: bf16 on CUDA, fp32/bf16 on the CPU, both widths 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    ok_dtypes = {"cuda": (torch.bfloat16,), "cpu": (torch.float32, torch.bfloat16)}.get(device_type, ())
    size = torch.empty((), dtype=dtype).element_size()
    return dtype in ok_dtypes and all((d * size) % 16 == 0 for d in (out_features, in_features))


def grouped_mm_allowed(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs ``x [N, in]`` against ``w [E, out, in]`` here."""
    return x.dtype == w.dtype and grouped_mm_supported(x.device.type, x.dtype, w.shape[1], w.shape[2])


def grouped_linear(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, kernel: Kernel = "auto") -> torch.Tensor:
    """``x [N, in]`` rows grouped by expert (``counts [E]`` rows each, in order) times each
    expert's ``w[e] [out, in]``: ``[N, out]``. ``kernel``: ``grouped_mm``, ``loop`` or ``auto``."""
    if kernel == "grouped_mm" or (kernel == "auto" and grouped_mm_allowed(x, w)):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        if out.requires_grad:  # its backward needs a contiguous gradient
            out.register_hook(torch.Tensor.contiguous)
        return out
    sizes = counts.tolist()  # host sync: the loop needs the group sizes
    return torch.cat([F.linear(rows, w[e]) for e, rows in enumerate(x.split(sizes))])


class GroupedExperts(nn.Module):
    """``local`` experts of ``experts``, each ``fc2(act(fc1(x)))`` without biases: ``w1 [E_l, f (2f
    for SwiGLU: [gate; up]), h]`` and ``w2 [E_l, h, f]``. Weights are drawn for all ``experts``
    and sliced (``first`` is this rank's first expert), so they do not depend on the expert-parallel
    layout. Expert-TP = 1 (``tp_size=1``): under sequence parallelism with ``t > 1`` every TP rank
    holds the same experts and routes its own tokens through them: their gradients are summed over
    TP (SP-replicated). Expert-TP = t (``tp_size=t``): each TP rank holds ``f/t`` of every expert's
    width (``w1``'s rows of each of gate and up, ``w2``'s columns), as column / row-parallel layers."""

    def __init__(self, experts: int, local: int, first: int, hidden: int, ffn: int, act: nn.Module, *,
                 gated: bool, std: float, out_std: float, dtype: torch.dtype, sp_replicated: bool = False,
                 kernel: Kernel = "auto", tp_rank: int = 0, tp_size: int = 1):
        """``act``: the activation on fc1's output (``gated``: SwiGLU on ``[gate | up]``, fc1 ``2f`` rows)."""
        super().__init__()
        rows = 2 * ffn if gated else ffn
        w1 = torch.empty(experts, rows, hidden, dtype=dtype).normal_(0.0, std)[first:first + local]
        w2 = torch.empty(experts, hidden, ffn, dtype=dtype).normal_(0.0, out_std)[first:first + local]
        piece = ffn // tp_size
        w1 = torch.cat([c.narrow(1, tp_rank * piece, piece) for c in w1.chunk(2 if gated else 1, dim=1)], dim=1)
        w2 = w2.narrow(2, tp_rank * piece, piece)
        self.w1, self.w2 = nn.Parameter(w1.clone()), nn.Parameter(w2.clone())
        self.experts, self.local, self.first, self.kernel = experts, local, first, kernel
        self.act = act  # a module of its own, so the memory ledger can name what it keeps
        self.sp_replicated, self.tp_size, self.chunks = sp_replicated and tp_size == 1, tp_size, 2 if gated else 1

    def param_layouts(self) -> dict[str, ParamLayout]:
        if self.tp_size > 1:  # column-parallel fc1 (per chunk), row-parallel fc2
            return {"w1": ParamLayout(split_dim=1, chunks=self.chunks), "w2": ParamLayout(split_dim=2)}
        lay = SP_REPLICATED if self.sp_replicated else REPLICATED
        return {"w1": lay, "w2": lay}

    def forward(self, x: torch.Tensor, counts: torch.Tensor, recompute: Callable | None = None) -> torch.Tensor:
        """``x [N, h]`` grouped by local expert (``counts [E_l]``) -> ``[N, h]``. ``recompute``: a
        checkpoint function (:func:`seqpar.recompute.checkpoint`) that runs fc1 and the activation
        without keeping the activation's input, and recomputes them in backward."""
        hidden = self._fc1_act(x, counts) if recompute is None else recompute(self._fc1_act, x, counts)
        return grouped_linear(hidden, self.w2, counts, self.kernel)

    def _fc1_act(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.act(grouped_linear(x, self.w1, counts, self.kernel))

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.local - 1} of {self.experts}, w1={tuple(self.w1.shape)}, "
                f"w2={tuple(self.w2.shape)}, kernel={self.kernel}")


__all__ = ["GroupedExperts", "grouped_linear", "grouped_mm_allowed", "grouped_mm_supported", "inverse_permutation", "permute",
           "sort_by_expert", "unpermute"]
