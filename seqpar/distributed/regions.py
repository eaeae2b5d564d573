"""The paper's communication operators as autograd functions (Korthikanti et al. §4.2).

Tensors are sequence-first ``[s, b, h]`` by default (``seq_dim=0``, seqpar's convention and its
layers' default), so a sequence shard is the contiguous dim-0 slice ``[s/t, b, h]`` and every
gather / reduce-scatter along the sequence is zero-copy. Batch-first callers (``[b, s, h]``, e.g.
Hugging Face models) pass ``seq_dim=1``: with the default the batch would be split instead, which
gives the right numbers but none of the memory saving. Errors name ``seq_dim`` and the shape.

A one-rank group (or ``group=None``) makes every operator the identity. A dimension that
is not divisible by the group size raises ``ValueError`` before any collective is issued.

=====================  ==========================  ===============================
function               forward                     backward
=====================  ==========================  ===============================
copy_to_tp       (f)   identity                    all-reduce
reduce_from_tp   (f̄)   all-reduce                  identity
gather_from_sp   (g)   all-gather along seq        reduce-scatter along seq
reduce_scatter_to_sp   reduce-scatter along seq    all-gather along seq
                 (ḡ)
scatter_to_sp          keep own seq chunk          all-gather along seq
gather_to_replicated   all-gather along seq        keep own seq chunk
gather_from_tp         all-gather along last dim   keep own chunk of last dim
split_to_tp            keep own chunk of last dim  all-gather along last dim
=====================  ==========================  ===============================
"""
from __future__ import annotations

import torch

from .collectives import (
    ProcessGroup,
    all_gather_dim,
    all_reduce,
    chunk_of,
    group_size,
    reduce_scatter_dim,
)


class _CopyToTP(torch.autograd.Function):
    """f: enter a TP region. Forward identity; backward all-reduce of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """f-bar: leave a TP region. Forward all-reduce (sum of partial results); backward identity."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    """g: all-gather sequence shards ``[s/t, b, h] -> [s, b, h]``; backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return all_gather_dim(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.group, ctx.seq_dim), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    """g-bar: sum partial results and keep own shard ``[s, b, h] -> [s/t, b, h]``; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return reduce_scatter_dim(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.group, ctx.seq_dim), None, None


class _ScatterToSP(torch.autograd.Function):
    """Enter the SP region from a replicated tensor: keep own sequence chunk; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group, seq_dim):
        ctx.group, ctx.seq_dim = group, seq_dim
        return chunk_of(x, group, seq_dim)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.group, ctx.seq_dim), None, None


class _GatherToReplicated(_GatherFromSP):
    """Leave the SP region into a replicated one: all-gather the sequence (as g); backward keeps own
    chunk (downstream every rank computes the same complete gradient; g's reduce-scatter would sum it t times)."""

    @staticmethod
    def backward(ctx, grad):
        return chunk_of(grad, ctx.group, ctx.seq_dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather the last dim ``[..., h/t] -> [..., h]``; backward keeps own chunk."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return chunk_of(grad, ctx.group, -1), None


class _SplitToTP(torch.autograd.Function):
    """Keep own chunk of the last dim ``[..., h] -> [..., h/t]``; backward all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return chunk_of(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.group, -1), None


def _check_dim(x: torch.Tensor, dim: int, t: int, op: str) -> None:
    """Raise ``ValueError`` before any collective unless ``x`` has sequence dim ``dim`` divisible by ``t``."""
    layouts = "seq_dim is 0 for sequence-first [s, b, h] tensors, 1 for batch-first [b, s, h]"
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{op}: seq_dim: dim {dim} is out of range for a tensor of shape {tuple(x.shape)} ({layouts})")
    if x.shape[dim] % t:
        raise ValueError(f"{op}: the sequence dim seq_dim={dim} of shape {tuple(x.shape)} ({x.shape[dim]}) is not "
                         f"divisible by the tensor-parallel size t={t} ({layouts})")


def _check_features(x: torch.Tensor, t: int, op: str) -> None:
    if x.dim() == 0 or x.shape[-1] % t:
        raise ValueError(f"{op}: the last (feature) dim of shape {tuple(x.shape)} "
                         f"({x.shape[-1] if x.dim() else 0}) is not divisible by the tensor-parallel size t={t}")


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Paper's f. Forward: identity. Backward: all-reduce over ``group``."""
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Paper's f-bar. Forward: all-reduce (sum) over ``group``. Backward: identity."""
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def gather_from_sp(x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 0) -> torch.Tensor:
    """Paper's g. Forward: all-gather along ``seq_dim`` (``[s/t,b,h] -> [s,b,h]``).
    Backward: reduce-scatter along ``seq_dim``."""
    if group_size(group) == 1:
        return x
    _check_dim(x, seq_dim, 1, "gather_from_sp")
    return _GatherFromSP.apply(x, group, seq_dim)


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 0) -> torch.Tensor:
    """Paper's g-bar. Forward: reduce-scatter (sum) along ``seq_dim`` (``[s,b,h] -> [s/t,b,h]``).
    Backward: all-gather along ``seq_dim``."""
    t = group_size(group)
    if t == 1:
        return x
    _check_dim(x, seq_dim, t, "reduce_scatter_to_sp")
    return _ReduceScatterToSP.apply(x, group, seq_dim)


def scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 0) -> torch.Tensor:
    """Forward: keep this rank's chunk of ``seq_dim`` (no communication).
    Backward: all-gather along ``seq_dim``."""
    t = group_size(group)
    if t == 1:
        return x
    _check_dim(x, seq_dim, t, "scatter_to_sp")
    return _ScatterToSP.apply(x, group, seq_dim)


def gather_to_replicated(x: torch.Tensor, group: ProcessGroup | None, seq_dim: int = 0) -> torch.Tensor:
    """Inverse of :func:`scatter_to_sp`. Forward: all-gather along ``seq_dim`` into a tensor every
    rank holds in full. Backward: keep this rank's chunk of the (replicated) gradient."""
    if group_size(group) == 1:
        return x
    _check_dim(x, seq_dim, 1, "gather_to_replicated")
    return _GatherToReplicated.apply(x, group, seq_dim)


def gather_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: all-gather along the last dim (``[..., h/t] -> [..., h]``).
    Backward: keep this rank's chunk of the last dim."""
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group)


def split_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim (``[..., h] -> [..., h/t]``).
    Backward: all-gather along the last dim."""
    t = group_size(group)
    if t == 1:
        return x
    _check_features(x, t, "split_to_tp")
    return _SplitToTP.apply(x, group)


__all__ = [
    "copy_to_tp",
    "reduce_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "gather_to_replicated",
    "gather_from_tp",
    "split_to_tp",
]
