"""The TP GEMMs with the paper's operators fused in: the one route from the linear layers to f, f-bar, g, g-bar.

================================  ===========================  ======================================
function                          plain TP                     sequence parallelism
================================  ===========================  ======================================
:func:`column_parallel_linear`    GEMM; backward f (the        g (all-gather of the sequence shard) then
                                  input grad all-reduced)      GEMM; backward re-gather + g's reduce-scatter
:func:`row_parallel_linear`       GEMM then f-bar              GEMM then g-bar (reduce-scatter)
                                  (all-reduce)
================================  ===========================  ======================================

Under SP with ``tp_overlap`` each collective is cut into per-rank chunks under the GEMMs
(:mod:`seqpar.layers.overlap`); eager only: a graph being compiled takes the plain collectives
(the compiler schedules, and on CUDA may fuse, them) and no asynchronous work handles.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..distributed.collectives import (ProcessGroup, all_gather_dim_async, all_reduce, group_size,
                                       reduce_scatter_dim_async)
from ..distributed.regions import reduce_from_tp, reduce_scatter_to_sp
from .overlap import all_gather_linear, linear_reduce_scatter


def _eager() -> bool:
    """Not inside a graph torch.compile traces: asynchronous handles and chunked rings may be used."""
    return not torch.compiler.is_compiling()


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


class _ColumnParallelLinearFn(torch.autograd.Function):
    """Linear on a TP-replicated or SP-sharded input, with the input communication fused in.

    Forward: SP all-gathers ``[s/t, b, in] -> [s, b, in]`` for the matmul (plain TP: nothing).
    Saves only the local input (the shard under SP) -- the paper's §4.2.2 memory saving.
    Backward: SP re-gathers the shard asynchronously while computing ``grad_input``, then
    reduce-scatters ``grad_input`` asynchronously while computing ``grad_weight``. Plain TP
    all-reduces ``grad_input`` (the paper's f) asynchronously behind ``grad_weight``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, seq_dim):
        ctx.group, ctx.sp, ctx.seq_dim = group, sequence_parallel, seq_dim
        ctx.has_bias = bias is not None
        ctx.autocast = (x.device.type, *_autocast_state(x.device.type))
        if ctx.autocast[1]:
            x = x.to(ctx.autocast[2])  # gather and save in the compute dtype
        total = all_gather_dim_async(x, group, seq_dim, async_op=False)[0] if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp, seq_dim = ctx.group, ctx.sp, ctx.seq_dim
        device_type, ac_enabled, ac_dtype = ctx.autocast
        overlap = _eager()  # compiled graphs take no async work handles
        with torch.autocast(device_type=device_type, dtype=ac_dtype, enabled=ac_enabled):
            gather = None
            if sp:
                total, gather = all_gather_dim_async(x, group, seq_dim, async_op=overlap)  # under the matmul below
            else:
                total = x
            grad_input = comm = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_out.matmul(weight)  # [s, b, in]
            if gather is not None:
                gather.wait()
            if grad_input is not None:
                if sp:
                    grad_input, comm = reduce_scatter_dim_async(grad_input, group, seq_dim, async_op=overlap)
                else:
                    comm = all_reduce(grad_input, group, async_op=overlap)
            go = grad_out.reshape(-1, grad_out.shape[-1])
            grad_weight = go.t().matmul(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
            grad_bias = go.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
            if comm is not None:
                comm.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _overlapped(sequence_parallel: bool, tp_overlap: bool) -> bool:
    """Whether SP's collectives run chunk by chunk under the GEMMs (:mod:`seqpar.layers.overlap`)."""
    return sequence_parallel and tp_overlap and _eager()


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                           tp_group: ProcessGroup | None, sequence_parallel: bool = False,
                           seq_dim: int = 0, tp_overlap: bool = False) -> torch.Tensor:
    """``x [s, b, in]`` (replicated) or ``[s/t, b, in]`` (SP shard) times this rank's output rows
    ``weight [out/t, in]`` -> ``[s, b, out/t]``. Under SP the all-gather (g) is fused into the matmul
    and only the shard is kept for backward; plain TP all-reduces the input gradient (f).
    ``tp_overlap`` (SP only): the all-gather cut into per-rank chunks, each under a chunk's GEMM."""
    if group_size(tp_group) == 1:
        return F.linear(x, weight, bias)
    if _overlapped(sequence_parallel, tp_overlap):
        return all_gather_linear(x, weight, bias, tp_group, seq_dim)
    return _ColumnParallelLinearFn.apply(x, weight, bias, tp_group, sequence_parallel, seq_dim)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        tp_group: ProcessGroup | None, sequence_parallel: bool = False,
                        seq_dim: int = 0, tp_overlap: bool = False) -> torch.Tensor:
    """``x [s, b, in/t]`` times this rank's input columns ``weight [out, in/t]``: partial sums
    all-reduced to ``[s, b, out]`` (f-bar) or reduce-scattered to ``[s/t, b, out]`` under SP
    (g-bar). ``bias`` is added after the reduction (one rank, no autocast: inside the GEMM, as
    ``nn.Linear``; under autocast the separate add keeps today's result dtype, as at t > 1).
    ``tp_overlap`` (SP only): the reduce-scatter cut into per-rank chunks, each sent while the next
    chunk's partial product is computed."""
    if group_size(tp_group) == 1 and not torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)  # nothing to reduce: x @ weight.T + bias in one addmm
    if group_size(tp_group) > 1 and _overlapped(sequence_parallel, tp_overlap):
        out = linear_reduce_scatter(x, weight, tp_group, seq_dim)  # [s, b, in/t] -> [s/t, b, out]
    elif sequence_parallel:
        out = reduce_scatter_to_sp(F.linear(x, weight), tp_group, seq_dim)  # [s, b, out] -> [s/t, b, out]
    else:
        out = reduce_from_tp(F.linear(x, weight), tp_group)  # partial sums [s, b, out], all-reduced
    return out + bias if bias is not None else out


__all__ = ["column_parallel_linear", "row_parallel_linear"]
