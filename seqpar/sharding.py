"""Parameter layouts over tensor parallelism, and the one place that converts dense <-> local.

Every seqpar layer declares how each parameter it owns is laid out across the ``t`` ranks of its
TP group in a :class:`ParamLayout` (its ``param_layouts()`` method); modules that are not seqpar
layers (norms, position tables) are replicated unless :func:`mark_sp_replicated` declares them
SP-replicated. Everything that needs a layout -- dense state dicts, gradient clipping,
checkpoints, interop, ``parallelize`` -- asks :func:`param_layouts` and converts with
:func:`shard` / :func:`unshard` / :func:`to_dense` / :func:`to_local`, so a new fused layer only
has to declare its layout.

A split parameter with ``chunks = c`` is ``c`` equal blocks along ``split_dim`` in the dense
tensor (fused ``[q; k; v]``: 3, fused ``[gate; up]``: 2), each block split over the ranks
separately: rank ``r`` holds ``[c_0,r; c_1,r; ...]``, so its rows of every block are contiguous.
Blocks may differ in size (grouped-query ``[q; k; v]``), each divisible by ``t``. A block of
fewer heads than ranks (``ParamLayout.groups``: grouped-query key/value heads at ``g < t``) is
split over its heads instead, each head held by the ``t/g`` consecutive ranks sharing it: a dense
tensor takes it from the first of them, and a norm counts it once (:func:`counted_parts`).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
import torch.nn as nn

from .distributed.collectives import ProcessGroup, all_gather_dim, group_rank, group_size
from .distributed.layouts import (ATTR, REPLICATED, SP_REPLICATED, ParamLayout, local_tensor,  # noqa: F401
                                  mark_sp_replicated, module_layouts, param_layouts, sp_replicated_parameters,
                                  split_parameters)

# ---------------------------------------------------------------------------------- conversions
def interleave(x: torch.Tensor, chunks: int, parts: int, dim: int = 0, inverse: bool = False) -> torch.Tensor:
    """Reorder ``x`` along ``dim`` from ``chunks`` blocks of ``parts`` pieces (chunk-major,
    ``[c0p0, c0p1, ..., c1p0, ...]``) to part-major (``[c0p0, c1p0, ..., c0p1, ...]``);
    ``inverse`` goes back. Fused ``[q; k; v]`` rows with ``parts = t`` give each rank's contiguous
    ``[q_r; k_r; v_r]``; with ``parts = heads`` the per-head ``[q_h, k_h, v_h]`` order."""
    if chunks == 1 or parts == 1:
        return x
    a, b = (parts, chunks) if inverse else (chunks, parts)
    moved = x.movedim(dim, 0)
    out = moved.reshape(a, b, -1, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
    return out.movedim(0, dim)


def local_shape(full_shape: Iterable[int], layout: ParamLayout, t: int) -> torch.Size:
    shape = list(full_shape)
    if layout.is_split:
        shape[layout.split_dim] = sum(layout.chunk_sizes(shape[layout.split_dim], t))
    return torch.Size(shape)


def dense_shape(local: Iterable[int], layout: ParamLayout, t: int) -> torch.Size:
    shape = list(local)
    if layout.is_split:
        shape[layout.split_dim] = layout.dense_size(shape[layout.split_dim], t)
    return torch.Size(shape)


def shard(full: torch.Tensor, layout: ParamLayout, rank: int, t: int) -> torch.Tensor:
    """This rank's part of the dense tensor ``full`` (a view when it is one contiguous block; no
    communication): its piece of every chunk (the ``rank``-th ``1/t``, or the piece of its
    replica set for grouped chunks, see :class:`ParamLayout`), concatenated."""
    if not layout.is_split or t == 1:
        return full
    dim = layout.split_dim
    sizes = layout.chunk_sizes(full.shape[dim], t)  # also checks divisibility, naming the shape
    blocks = layout.blocks(sum(sizes), rank, t)
    if len(blocks) == 1:
        return full.narrow(dim, blocks[0][2], blocks[0][1])
    return torch.cat([full.narrow(dim, start, n) for _, n, start in blocks], dim)


def unshard(local: torch.Tensor, layout: ParamLayout, group: ProcessGroup | None) -> torch.Tensor:
    """The dense tensor from every rank's part (an all-gather over ``group`` when split; a copy
    otherwise). A collective: call on every TP rank."""
    local = local.detach()
    t = group_size(group)
    if not layout.is_split or t == 1:
        return local.clone()
    dim = layout.split_dim
    gathered = all_gather_dim(local, group, dim)  # [rank 0's part; rank 1's part; ...]
    sizes = layout.chunk_sizes(layout.dense_size(local.shape[dim], t), t)
    if len(sizes) == 1 and not layout.is_replicated(t):
        return gathered
    pieces = [part.split(sizes, dim) for part in gathered.chunk(t, dim)]  # [rank][chunk]
    # each chunk's pieces in order, a replicated piece taken from the first rank holding it
    return torch.cat([pieces[r][c] for c, rep in enumerate(layout.replicas(t)) for r in range(0, t, rep)], dim)


def counted_parts(x: torch.Tensor, layout: ParamLayout, local_size: int, rank: int, t: int, *,
                  row_start: int = 0) -> list[torch.Tensor]:
    """Views of ``x`` that this rank counts in a global norm over TP, so that a replicated piece
    (:meth:`ParamLayout.is_replicated`) counts once: ``[x]`` for a parameter without replicas.
    ``x``: this rank's local tensor of extent ``local_size`` along ``split_dim``, or (FSDP) its
    dim-0 rows from ``row_start`` on."""
    if not layout.is_replicated(t):
        return [x]
    dim, out = layout.split_dim, []
    lo = row_start if dim == 0 else 0
    hi = lo + x.shape[dim]
    for (start, n, _), counted in zip(layout.blocks(local_size, rank, t), layout.counted(rank, t)):
        a, b = max(lo, start), min(hi, start + n)
        if counted and b > a:
            out.append(x.narrow(dim, a - lo, b - a))
    return out


def to_dense(model: nn.Module, local: Mapping[str, torch.Tensor], group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Per-parameter tensors keyed by parameter name (parameters, their gradients or optimizer
    moments) -> their dense, layout-invariant form. Names missing from ``local`` are skipped.
    A collective over ``group`` (TP): call on every rank with the same names."""
    return {name: unshard(local[name], lay, group) for name, lay in param_layouts(model).items() if name in local}


def to_local(model: nn.Module, dense: Mapping[str, torch.Tensor], group: ProcessGroup | None) -> dict[str, torch.Tensor]:
    """Dense tensors (as from :func:`to_dense`) -> this rank's parts. No communication."""
    rank, t = group_rank(group), group_size(group)
    return {name: shard(dense[name], lay, rank, t) for name, lay in param_layouts(model).items() if name in dense}


def copy_into(params: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor], what: str) -> None:
    """Copy ``values[name]`` into each ``params[name]`` in place, after checking that the names and
    the shapes agree (``ValueError`` naming ``what`` and the offending names/shapes)."""
    missing, unexpected = sorted(set(params) - set(values)), sorted(set(values) - set(params))
    if missing or unexpected:
        raise ValueError(f"{what}: mismatch: missing {missing}, unexpected {unexpected}")
    bad = [f"{n}: {tuple(values[n].shape)} != {tuple(p.shape)}" for n, p in params.items()
           if values[n].shape != p.shape]
    if bad:
        raise ValueError(f"{what}: shape mismatch: {bad}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(values[n])


def dense_shapes(model: nn.Module, group: ProcessGroup | None) -> dict[str, torch.Size]:
    """Parameter name -> the dense shape of that parameter."""
    t = group_size(group)
    params = dict(model.named_parameters())
    return {name: dense_shape(params[name].shape, lay, t) for name, lay in param_layouts(model).items()}


__all__ = ["local_tensor", "ParamLayout", "REPLICATED", "SP_REPLICATED", "mark_sp_replicated", "module_layouts", "param_layouts",
           "sp_replicated_parameters", "split_parameters", "interleave", "local_shape", "dense_shape", "shard",
           "unshard", "counted_parts", "to_dense", "to_local", "dense_shapes", "copy_into"]
