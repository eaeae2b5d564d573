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

The layers reach the paper's operators through one route, their functional forms
(:mod:`seqpar.layers.functional`: each GEMM with its f / f-bar / g / g-bar, plain or overlapped).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, check_divisible, check_group, group_rank, group_size
from ..distributed.grad_sync import replica_grad_sum
from ..distributed.regions import gather_from_tp, split_to_tp
from ..sharding import REPLICATED, SP_REPLICATED, ParamLayout, shard, unshard
from ._init import InitMethod, build_param, default_linear_init, skip_init
from .functional import column_parallel_linear, row_parallel_linear


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
