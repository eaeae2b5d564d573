"""Sharded checkpoint I/O: every rank writes and reads only the parts of the dense tensors it holds.

A checkpoint stores each parameter and AdamW moment under its dense name with its dense shape
(``model.<name>``, ``optim.exp_avg.<name>``, ``optim.exp_avg_sq.<name>``: the layout-invariant
form of :meth:`GPT.dense_state_dict`, the true vocabulary rows only), as a list of chunks in
``torch.distributed.checkpoint``'s metadata. A rank's local tensor -- its TP shard
(:mod:`seqpar.sharding` layouts, fused ``[q; k; v]`` and ``[gate; up]`` blocks included), or
FSDP2's dim-0 slice of it over dp (a DTensor's local part) -- maps to a few rectangular pieces
of the dense tensor (:func:`dense_pieces`; one per fused block). On save each rank hands DCP its
pieces as views of its own storage (ranks holding the same piece, TP replicas of a norm say,
write it once: DCP deduplicates equal chunks); on load each rank asks DCP for exactly the
dense ranges its pieces cover and DCP reads them from whichever saved chunks overlap them, so
any (tp, dp, data_parallel) layout loads any other. No rank gathers a tensor from another rank
and no collective carries tensor data: DCP's own collectives exchange plans (pickled metadata).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..model.moe_sharding import expert_dense_shapes, expert_rows
from ..model.vocab import VOCAB_PARAMS, true_dense_shapes
from ..parallel.fsdp import shard_rows
from ..sharding import ParamLayout, local_tensor, param_layouts

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Piece:
    """``tensor`` (a view of a rank's own storage) is the block of a dense tensor starting at ``offsets``."""

    offsets: tuple[int, ...]
    tensor: torch.Tensor


@dataclass
class DenseParts:
    """The pieces one rank holds of the dense tensor of shape ``size``."""

    size: torch.Size
    pieces: list[Piece]


def _rows_of(t: torch.Tensor, row_start: int) -> tuple[int, int]:
    return row_start, row_start + (t.shape[0] if t.dim() else 0)


def dense_pieces(x: torch.Tensor, layout: ParamLayout, local_full: torch.Size, tp_rank: int, t: int, *,
                 row_start: int = 0, dense_rows: int | None = None) -> list[Piece]:
    """Pieces of the dense tensor held by ``x``: rows ``[row_start, row_start + len(x))`` of this
    TP rank's shard (full shape ``local_full``; FSDP slices dim 0) of a parameter laid out by
    ``layout``. ``dense_rows`` cuts the dense dim 0 (the padded vocabulary rows are not stored)."""
    ndim = len(local_full)
    if not layout.is_split or t == 1:
        blocks = [(None, 0, 0, 0)]  # (dim, local start, size, dense start) of the whole
    else:
        d = layout.split_dim  # replicated pieces (g < t key/value heads) are written once: DCP dedups them
        blocks = [(d, s, n, dense_s) for s, n, dense_s in layout.blocks(local_full[d], tp_rank, t)]
    a, b = _rows_of(x, row_start)
    out = []
    for d, s, n, dense_s in blocks:
        offsets, piece = [a] + [0] * (ndim - 1), x
        if d == 0:  # the block's rows intersected with the rows x holds
            lo, hi = max(a, s), min(b, s + n)
            if hi <= lo:
                continue
            piece, offsets[0] = x.narrow(0, lo - a, hi - lo), dense_s + (lo - s)
        elif d is not None:
            piece, offsets[d] = x.narrow(d, s, n), dense_s
        if dense_rows is not None and ndim:
            keep = min(piece.shape[0], dense_rows - offsets[0])
            if keep <= 0:
                continue
            piece = piece.narrow(0, 0, keep)
        if piece.numel():
            out.append(Piece(tuple(offsets), piece))
    return out


def _fsdp_row_start(p: torch.Tensor, local: torch.Tensor) -> int:
    """First dim-0 row of the TP shard that this rank's FSDP slice holds (0 without FSDP)."""
    if local is p:
        return 0
    from torch.distributed.tensor import Shard
    if any(not (isinstance(pl, Shard) and pl.dim == 0) for pl in p.placements):
        raise ValueError(f"sharded checkpoints expect FSDP's Shard(0) placement, got {p.placements}")
    mesh = p.device_mesh
    return shard_rows(p.shape[0], mesh.get_local_rank(), mesh.size())[0]


def model_parts(model: nn.Module, tensors: dict[str, torch.Tensor], *, prefix: str) -> dict[str, DenseParts]:
    """``prefix + name`` -> the dense parts this rank holds of ``tensors[name]`` (parameters or
    AdamW moments keyed by parameter name; shaped and placed like the parameter). ``model``: a
    seqpar ``GPT`` or one pipeline stage of it (parameters under the GPT's names)."""
    shapes = expert_dense_shapes(model, true_dense_shapes(model))
    first_expert = expert_rows(model)  # experts split over ep: this rank's rows of the dense [E, ...]
    t, rank = model.tp_size, model.tp_rank
    out = {}
    for name, layout in param_layouts(model).items():
        if name not in tensors:
            continue
        full, local = tensors[name], local_tensor(tensors[name])
        row_start = _fsdp_row_start(full, local) + first_expert.get(name, 0)
        pieces = dense_pieces(local.detach(), layout, full.shape, rank, t, row_start=row_start,
                              dense_rows=shapes[name][0] if name in VOCAB_PARAMS else None)
        out[prefix + name] = DenseParts(shapes[name], pieces)
    return out


def optimizer_moments(model: nn.Module, optimizer: torch.optim.Optimizer, *, create: bool = False,
                      step: float = 0.0) -> dict[str, dict[str, torch.Tensor]]:
    """``{"exp_avg": {name: tensor}, "exp_avg_sq": {...}}`` of AdamW's state. ``create``: first give
    every trainable parameter zero moments and step ``step`` (before loading them)."""
    fused = any(g.get("fused") for g in optimizer.param_groups)
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in MOMENTS}
    for name, p in model.named_parameters():
        if create and p.requires_grad:
            device = p.device if fused else "cpu"  # fused AdamW keeps its step counters on the device
            optimizer.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=device),
                                  **{k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in MOMENTS}}
        st = optimizer.state.get(p, {})
        for k in MOMENTS:
            if k in st:
                out[k][name] = st[k]
    return out


def training_parts(modules: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer | None
                   ) -> dict[str, DenseParts]:
    """Every dense part of the parameters and (with ``optimizer``) AdamW moments of ``modules``
    (the GPT, or this rank's pipeline stages) on this rank."""
    parts: dict[str, DenseParts] = {}
    for module in modules if isinstance(modules, (list, tuple)) else [modules]:
        parts.update(model_parts(module, dict(module.named_parameters()), prefix="model."))
        if optimizer is not None:
            for key, tensors in optimizer_moments(module, optimizer).items():
                parts.update(model_parts(module, tensors, prefix=f"optim.{key}."))
    return parts


def coverage_problem(modules: nn.Module | list[nn.Module], optimizer: torch.optim.Optimizer | None) -> str | None:
    """Why a checkpoint of ``modules`` and ``optimizer`` would miss entries, or None: a trainable
    parameter the optimizer does not hold (FSDP2's gathered copy left registered after a forward
    with no backward), or one without AdamW moments once the optimizer has taken a step."""
    if optimizer is None:
        return None
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stepped = any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"])
    foreign, no_moments = [], []
    for module in modules if isinstance(modules, (list, tuple)) else [modules]:
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if id(p) not in known:
                foreign.append(name)
            elif stepped and any(k not in optimizer.state.get(p, {}) for k in MOMENTS):
                no_moments.append(name)
    if foreign:
        return (f"{len(foreign)} parameter(s) are not the optimizer's ({', '.join(foreign[:4])}): a module still "
                f"holds gathered FSDP parameters after a forward with no backward")
    if no_moments:
        return f"{len(no_moments)} parameter(s) have no AdamW moments ({', '.join(no_moments[:4])})"
    return None


class StagingBuffers:
    """CPU snapshots of a rank's pieces for background saves: each buffer is allocated on the
    first save (pinned when CUDA is available) and reused by every later one, and filled with
    non-blocking copies followed by one synchronize, so the main thread waits once per save for
    the copies alone. ``busy`` while a save still reads them (set and cleared by the caller)."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.busy = False

    def stage(self, parts: dict[str, DenseParts]) -> dict[str, DenseParts]:
        """``parts`` with every piece replaced by its CPU buffer, holding the piece's values."""
        pin, on_device, out = torch.cuda.is_available(), False, {}
        for fqn, dp in parts.items():
            pieces = []
            for p in dp.pieces:
                src = p.tensor.detach()
                buf = self._buffers.get((fqn, p.offsets))
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                    self._buffers[(fqn, p.offsets)] = buf
                buf.copy_(src, non_blocking=True)
                on_device |= src.device.type == "cuda"
                pieces.append(Piece(p.offsets, buf))
            out[fqn] = DenseParts(dp.size, pieces)
        if on_device:
            torch.cuda.synchronize()  # the one sync point: every copy has landed before the writes start
        return out


class PartsSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the plain entries, plus one chunk per :class:`Piece` of ``parts``.
    ``copy``: snapshot the pieces into CPU memory now (for a background save while training goes
    on), into ``staging``'s reused buffers when given, else into fresh ones."""

    def __init__(self, parts: dict[str, DenseParts], *, copy: bool = False, staging: StagingBuffers | None = None):
        super().__init__()
        if copy:
            parts = (staging or StagingBuffers()).stage(parts)
        self.parts = parts
        self._by_index = {(fqn, p.offsets): p.tensor for fqn, dp in parts.items() for p in dp.pieces}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = []
        for fqn, dp in self.parts.items():
            for p in dp.pieces:
                offsets = torch.Size(p.offsets)
                items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                       tensor_data=TensorWriteData(
                                           chunk=ChunkStorageMetadata(offsets=offsets, sizes=p.tensor.shape),
                                           properties=TensorProperties.create_from_tensor(p.tensor), size=dp.size)))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        key = (write_item.index.fqn, tuple(write_item.index.offset))
        if key in self._by_index:
            return self._by_index[key]
        return super().resolve_data(write_item)


class PartsLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for the plain entries; each :class:`Piece` of ``parts`` is filled in
    place from the saved chunks that overlap it."""

    def __init__(self, parts: dict[str, DenseParts]):
        super().__init__()
        self.parts = parts
        self._by_index = {(fqn, p.offsets): p.tensor for fqn, dp in parts.items() for p in dp.pieces}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        saved = self.metadata.state_dict_metadata
        for fqn, dp in self.parts.items():
            md = saved.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"checkpoint has no tensor {fqn!r}; it has {len(saved)} entries such as "
                                 f"{sorted(saved)[:4]}")
            if md.size != dp.size:
                raise ValueError(f"checkpoint tensor {fqn!r} has shape {tuple(md.size)}, this model needs "
                                 f"{tuple(dp.size)}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.tensor.shape) for p in dp.pieces]
            items += create_read_items_for_chunk_list(fqn, md, chunks)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_tensor(self, read_item):
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        if key in self._by_index:
            t = self._by_index[key]
            for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                t = t.narrow(dim, start, length)
            return t
        return super().resolve_tensor(read_item)


__all__ = ["DenseParts", "MOMENTS", "coverage_problem", "PartsLoadPlanner", "PartsSavePlanner", "Piece", "StagingBuffers", "dense_pieces",
           "model_parts", "optimizer_moments", "training_parts"]
