"""Column- and row-parallel linear layers (Megatron-style TP), with sequence parallelism as a mode.

Shapes are sequence-first by default: ``seq_dim=0``, seqpar's convention, where a sequence shard
is a contiguous dim-0 slice. Batch-first models (``[b, s, h]``, e.g. Hugging Face ones) pass
``seq_dim=1`` (``seqpar.parallelize`` does so through the plan's ``seq_dim``); left at 0 on
batch-first input, sequence parallelism would split the batch instead of the sequence. With ``t``
ranks in ``tp_group``:

* ``ColumnParallelLinear``: weight ``[out/t, in]``. Input ``[s, b, in]`` replicated (plain TP)
  or ``[s/t, b, in]`` sequence shard (SP); output ``[s, b, out/t]``.
* ``RowParallelLinear``: weight ``[out, in/t]``. Input ``[s, b, in/t]``; output ``[s, b, out]``
  all-reduced (plain TP) or ``[s/t, b, out]`` reduce-scattered (SP). Bias after the reduction.

``tp_overlap=True`` (SP only; ``parallel.tp_overlap``, :func:`seqpar.parallel.apply_tp_overlap`):
the all-gather and the reduce-scatter cut into per-rank chunks, each transfer under another
chunk's GEMM, forward and backward (:mod:`seqpar.layers.overlap`); same results, bytes and saved tensors.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import (
    ProcessGroup,
    all_gather_dim,
    all_gather_dim0,
    all_reduce,
    check_divisible,
    check_group,
    group_rank,
    group_size,
    reduce_scatter_dim,
    reduce_scatter_dim0,
)
from ..distributed.grad_sync import replica_grad_sum
from ..distributed.regions import gather_from_tp, reduce_from_tp, reduce_scatter_to_sp, split_to_tp
from ..sharding import REPLICATED, SP_REPLICATED, ParamLayout, shard, unshard
from ._init import InitMethod, build_param, default_linear_init, skip_init
from .overlap import all_gather_linear, linear_reduce_scatter


def _gather_seq(x, group, seq_dim, async_op):
    if seq_dim == 0:
        return all_gather_dim0(x, group, async_op=async_op)
    return all_gather_dim(x, group, seq_dim), None


def _reduce_scatter_seq(x, group, seq_dim, async_op):
    if seq_dim == 0:
        return reduce_scatter_dim0(x, group, async_op=async_op)
    return reduce_scatter_dim(x, group, seq_dim), None


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
        total = _gather_seq(x, group, seq_dim, False)[0] if sequence_parallel else x
        ctx.save_for_backward(x, weight)
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        group, sp, seq_dim = ctx.group, ctx.sp, ctx.seq_dim
        device_type, ac_enabled, ac_dtype = ctx.autocast
        overlap = not torch.compiler.is_compiling()  # compiled graphs take no async work handles
        with torch.autocast(device_type=device_type, dtype=ac_dtype, enabled=ac_enabled):
            gather = None
            if sp:
                total, gather = _gather_seq(x, group, seq_dim, overlap)  # overlaps the matmul below
            else:
                total = x
            grad_input = comm = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_out.matmul(weight)  # [s, b, in]
            if gather is not None:
                gather.wait()
            if grad_input is not None:
                if sp:
                    grad_input, comm = _reduce_scatter_seq(grad_input, group, seq_dim, overlap)
                else:
                    comm = all_reduce(grad_input, group, async_op=overlap)
            go = grad_out.reshape(-1, grad_out.shape[-1])
            grad_weight = go.t().matmul(total.reshape(-1, total.shape[-1])) if ctx.needs_input_grad[1] else None
            grad_bias = go.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
            if comm is not None:
                comm.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _overlapped(sequence_parallel: bool, tp_overlap: bool) -> bool:
    """Whether SP's collectives run chunk by chunk under the GEMMs (:mod:`seqpar.layers.overlap`).
    Compiled graphs take the plain collectives (the compiler schedules, and on CUDA may fuse, them)."""
    return sequence_parallel and tp_overlap and not torch.compiler.is_compiling()


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
    (g-bar). ``bias`` is added after the reduction. ``tp_overlap`` (SP only): the reduce-scatter
    cut into per-rank chunks, each sent while the next chunk's partial product is computed."""
    if group_size(tp_group) > 1 and _overlapped(sequence_parallel, tp_overlap):
        out = linear_reduce_scatter(x, weight, tp_group, seq_dim)  # [s, b, in/t] -> [s/t, b, out]
    elif sequence_parallel:
        out = reduce_scatter_to_sp(F.linear(x, weight), tp_group, seq_dim)  # [s, b, out] -> [s/t, b, out]
    else:
        out = reduce_from_tp(F.linear(x, weight), tp_group)  # partial sums [s, b, out], all-reduced
    return out + bias if bias is not None else out


class _ParallelLinearBase(nn.Module):
    def _setup(self, in_features, out_features, tp_group, sequence_parallel, seq_dim, tp_overlap):
        check_group(tp_group, type(self).__name__)
        self.in_features, self.out_features = in_features, out_features
        self.tp_group = tp_group
        self.tp_size, self.tp_rank = group_size(tp_group), group_rank(tp_group)
        self.sequence_parallel = bool(sequence_parallel)
        self.seq_dim = seq_dim
        self.tp_overlap = tp_overlap

    @property
    def tp_overlap(self) -> bool:
        """SP's collective cut into per-rank chunks under the GEMM (:mod:`seqpar.layers.overlap`)."""
        return self._tp_overlap

    @tp_overlap.setter
    def tp_overlap(self, on: bool) -> None:
        if on and not self.sequence_parallel:
            raise ValueError(f"{type(self).__name__}: tp_overlap=True overlaps sequence parallelism's all-gather / "
                             f"reduce-scatter with the GEMM; it needs sequence_parallel=True")
        self._tp_overlap = bool(on)

    def _check_input(self, x: torch.Tensor, expected_last: int) -> None:
        if x.shape[-1] != expected_last:
            raise ValueError(f"{type(self).__name__}: input's last dim is {x.shape[-1]} but the layer expects "
                             f"{expected_last} (input shape {tuple(x.shape)})")
        if self.sequence_parallel and (x.dim() < 2 or not -x.dim() <= self.seq_dim < x.dim()):
            raise ValueError(f"{type(self).__name__}: sequence parallelism needs a sequence dim (seq_dim="
                             f"{self.seq_dim}); got input shape {tuple(x.shape)}")

    def load_dense(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's part of the full ``weight [out, in]`` (and ``bias [out]``) in."""
        _check_full(self, weight, (self.out_features, self.in_features), bias)
        layouts = self.param_layouts()
        with torch.no_grad():
            self.weight.copy_(shard(weight, layouts["weight"], self.tp_rank, self.tp_size))
            if self.bias is not None:
                self.bias.copy_(shard(bias, layouts["bias"], self.tp_rank, self.tp_size))

    def dense_weight(self) -> torch.Tensor:
        """The full ``[out, in]`` weight, all-gathered over TP (a collective: call on every rank)."""
        return unshard(self.weight, self.param_layouts()["weight"], self.tp_group)

    def dense_bias(self) -> torch.Tensor | None:
        """The full ``[out]`` bias (all-gathered over TP where it is split)."""
        return None if self.bias is None else unshard(self.bias, self.param_layouts()["bias"], self.tp_group)

    def extra_repr(self) -> str:
        w = self.weight
        return (f"in_features={self.in_features}, out_features={self.out_features}, local_weight={tuple(w.shape)}, "
                f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}"
                + (f", seq_dim={self.seq_dim}" if self.sequence_parallel else "")
                + (", tp_overlap=True" if self.tp_overlap else ""))

    @classmethod
    def from_dense(cls, linear: nn.Linear, *, tp_group: ProcessGroup | None, sequence_parallel: bool = False, **kw):
        """This rank's slice of a dense ``nn.Linear`` (weights copied, nothing else drawn)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, tp_group=tp_group,
                    sequence_parallel=sequence_parallel, dtype=linear.weight.dtype, device=linear.weight.device,
                    init_method=skip_init, **kw)
        layer.load_dense(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return layer


class ColumnParallelLinear(_ParallelLinearBase):
    """``y = x A^T + b`` with ``A`` split by output rows: rank ``r`` holds ``A[r*out/t:(r+1)*out/t]``.

    Plain TP: input ``[s, b, in]`` identical on all ranks -> ``[s, b, out/t]``.
    SP (``sequence_parallel=True``): input ``[s/t, b, in]`` -> ``[s, b, out/t]``; the all-gather
    (paper's g) is fused into the matmul and only the shard is kept for backward.
    ``chunks=c``: the output is ``c`` fused blocks (``[q; k; v]``: 3; unequal blocks as a tuple of
    relative sizes, e.g. grouped-query ``(a, g, g)``) split over TP separately, so
    rank ``r`` computes its part of each block. ``gather_output=True`` all-gathers the output's
    last dim to ``[s, b, out]`` (in this rank-major order when ``chunks > 1``).
    ``groups``: per chunk, its number of heads (or None), for heads that may be fewer than ``t``:
    such a chunk is split over its heads and each head replicated over ``t/heads`` consecutive
    ranks (grouped-query key/value heads at ``t > g``), its gradient summed over those ranks in
    backward. See :class:`~seqpar.sharding.ParamLayout`.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, gather_output: bool = False, dtype: torch.dtype | None = None,
                 device=None, init_method: InitMethod | None = None, per_shard_init: bool = False, seq_dim: int = 0,
                 chunks: int | tuple[int, ...] = 1, groups: tuple[int | None, ...] | None = None,
                 tp_overlap: bool = False):
        super().__init__()
        self._setup(in_features, out_features, tp_group, sequence_parallel, seq_dim, tp_overlap)
        layout = ParamLayout(split_dim=0, chunks=chunks, groups=groups)  # validates chunks and groups
        try:
            layout.chunk_sizes(out_features, self.tp_size)
        except ValueError as e:
            raise ValueError(f"ColumnParallelLinear: out_features {out_features} is not divisible by t={self.tp_size} "
                             f"x chunks={chunks}" + (f" ({e})" if groups else "")) from None
        self.gather_output, self.chunks, self.groups = gather_output, chunks, groups
        self.weight = build_param((out_features, in_features), layout, self.tp_rank, self.tp_size,
                                  init_method or default_linear_init, dtype=dtype, device=device,
                                  per_shard_init=per_shard_init)
        self.bias = _build_bias(out_features, in_features, layout, self, bias, init_method, dtype, device,
                                per_shard_init)

    def param_layouts(self) -> dict[str, ParamLayout]:
        layout = ParamLayout(split_dim=0, chunks=self.chunks, groups=self.groups)
        return {"weight": layout, "bias": layout}

    def summed_params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weight and bias as the matmul uses them: replicated heads' gradients summed over the
        ranks sharing them in backward (:func:`~seqpar.distributed.grad_sync.replica_grad_sum`)."""
        layout = self.param_layouts()["weight"]
        return (replica_grad_sum(self.weight, layout, self.tp_group),
                replica_grad_sum(self.bias, layout, self.tp_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features)
        weight, bias = self.summed_params()
        out = column_parallel_linear(x, weight, bias, tp_group=self.tp_group, sequence_parallel=self.sequence_parallel,
                                     seq_dim=self.seq_dim, tp_overlap=self.tp_overlap)
        return gather_from_tp(out, self.tp_group) if self.gather_output else out


class RowParallelLinear(_ParallelLinearBase):
    """``y = x A^T + b`` with ``A`` split by input columns: rank ``r`` holds ``A[:, r*in/t:(r+1)*in/t]``.

    Input ``[s, b, in/t]`` (``input_is_parallel=True``, the usual output of a column layer) or
    ``[s, b, in]`` (split here). Output: plain TP all-reduces (paper's f-bar) to ``[s, b, out]``;
    SP reduce-scatters (paper's g-bar) to ``[s/t, b, out]``. The bias is added after the
    reduction; under SP it is SP-replicated (its gradient is summed over TP by grad_sync).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, input_is_parallel: bool = True, dtype: torch.dtype | None = None,
                 device=None, init_method: InitMethod | None = None, per_shard_init: bool = False, seq_dim: int = 0,
                 tp_overlap: bool = False):
        super().__init__()
        self._setup(in_features, out_features, tp_group, sequence_parallel, seq_dim, tp_overlap)
        check_divisible(in_features, self.tp_size, "RowParallelLinear in_features")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        self.input_is_parallel = input_is_parallel
        self.weight = build_param((out_features, in_features), ParamLayout(split_dim=1), self.tp_rank, self.tp_size,
                                  init_method or default_linear_init, dtype=dtype, device=device,
                                  per_shard_init=per_shard_init)
        self.bias = _build_bias(out_features, in_features, REPLICATED, self, bias, init_method, dtype, device,
                                per_shard_init)

    def param_layouts(self) -> dict[str, ParamLayout]:
        sp = self.sequence_parallel and self.tp_size > 1  # each rank adds the bias to its own tokens only
        return {"weight": ParamLayout(split_dim=1), "bias": SP_REPLICATED if sp else REPLICATED}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_is_parallel:
            self._check_input(x, self.in_features // self.tp_size)
        else:
            self._check_input(x, self.in_features)
            x = split_to_tp(x, self.tp_group)
        return row_parallel_linear(x, self.weight, self.bias, tp_group=self.tp_group,
                                   sequence_parallel=self.sequence_parallel, seq_dim=self.seq_dim,
                                   tp_overlap=self.tp_overlap)


def _build_bias(out_features, in_features, layout, layer, bias, init_method, dtype, device, per_shard_init):
    """nn.Linear's bias init (uniform +-1/sqrt(fan_in)) by default, zeros with a custom init_method."""
    if not bias:
        return None
    if init_method is skip_init:
        init = skip_init
    elif init_method is None:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
        init = lambda b: nn.init.uniform_(b, -bound, bound)  # noqa: E731
    else:
        init = nn.init.zeros_
    layout = ParamLayout(split_dim=0, chunks=layout.chunks, groups=layout.groups) if layout.is_split else REPLICATED
    return build_param((out_features,), layout, layer.tp_rank, layer.tp_size, init, dtype=dtype, device=device,
                       per_shard_init=per_shard_init)


def _check_full(layer, weight, shape, bias) -> None:
    if tuple(weight.shape) != shape:
        raise ValueError(f"{type(layer).__name__}: full weight must have shape {shape}, got {tuple(weight.shape)}")
    if (bias is None) != (layer.bias is None):
        raise ValueError(f"{type(layer).__name__}: bias given={bias is not None} but layer has bias={layer.bias is not None}")
    if bias is not None and tuple(bias.shape) != (shape[0],):
        raise ValueError(f"{type(layer).__name__}: full bias must have shape {(shape[0],)}, got {tuple(bias.shape)}")
