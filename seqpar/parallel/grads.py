"""Gradients across pipeline stages: the tied token table, and the global norm for clipping.

With tied embeddings and ``p > 1`` the first stage (lookup) and the last stage (output layer)
each hold a copy of ``wte.weight``; after backward both copies' gradients are summed over the
pair, once, so the copies stay equal. The global norm counts that parameter once (the last
stage's copy is left out), each TP-split parameter's squares summed over TP, each parameter
replicated over TP (norms, biases of row-parallel layers, positions) once, and DP shards
(FSDP2 DTensor gradients) summed over DP while DP-replicated gradients count once: one
all-reduce over the whole world. A split parameter's pieces replicated over TP (grouped-query
key/value heads at ``g < t``) count once, on the first rank sharing them (:func:`replica_views`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, all_reduce, group_size
from ..sharding import counted_parts, local_tensor, param_layouts, split_parameters
from .fsdp import shard_rows


def tied_embedding_group(mesh) -> ProcessGroup | None:
    """The group {first stage, last stage} of this rank's (dp, tp) coordinate (``None`` for
    ``p = 1``). ``new_group`` is collective: every rank calls this, in the same order."""
    p, dp, tp = mesh.pp_size, mesh.dp_size, mesh.tp_size
    if p == 1:
        return None
    if p == 2:
        return mesh.pp_group
    mine, stage = None, dp * tp  # ranks per pipeline stage
    for j in range(stage):
        group = dist.new_group([j, (p - 1) * stage + j])
        if mesh.rank % stage == j:
            mine = group
    return mine


def sum_tied_grads(params: list[nn.Parameter], group: ProcessGroup | None) -> None:
    """Sum the tied copies' gradients over ``group`` (first and last stage), once per step.
    A missing gradient counts as zero, so both ends always join the collective."""
    if group_size(group) == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        all_reduce(p.grad, group)


def _local_grad(g: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(local tensor, sharded over dp): a DTensor gradient (FSDP2) is this rank's dp shard."""
    local = getattr(g, "_local_tensor", None)
    return (g, False) if local is None else (local, True)


def replica_views(module: nn.Module, tp_rank: int, t: int) -> dict[int, list[torch.Tensor]]:
    """``id(p)`` -> the views of ``p``'s local gradient (its FSDP2 shard where sharded) that this
    rank counts in a norm over TP, for each split parameter holding replicated pieces (others are
    counted whole and are not listed)."""
    params, out = dict(module.named_parameters()), {}
    for name, layout in param_layouts(module).items():
        p = params[name]
        if p.grad is None or not layout.is_replicated(t):
            continue
        local = local_tensor(p.grad.detach())
        row_start = 0
        if hasattr(p.grad, "device_mesh") and layout.split_dim == 0:  # FSDP2: this dp rank's dim-0 rows
            mesh = p.grad.device_mesh
            row_start = shard_rows(p.shape[0], mesh.get_local_rank(), mesh.size())[0]
        out[id(p)] = counted_parts(local, layout, p.shape[layout.split_dim], tp_rank, t, row_start=row_start)
    return out


def clip_grad_norm_pp(module: nn.Module, max_norm: float, mesh, exclude: list[nn.Parameter] = ()) -> torch.Tensor:
    """Global L2 norm of the full model's gradients over pp x dp x tp, from this rank's stages
    ``module`` (``exclude``: tied copies already counted on another stage). Scales the grads in
    place by ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0``. Returns the norm before
    clipping (fp32 or wider, identical on every rank). One all-reduce over the world."""
    skip = {id(p) for p in exclude}
    split = split_parameters(module) if mesh.tp_size > 1 else set()
    views = replica_views(module, mesh.tp_rank, mesh.tp_size) if split else {}
    params = [p for p in module.parameters() if p.grad is not None]
    device = params[0].grad.device if params else mesh.device
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if id(p) in skip:
            continue
        g, dp_sharded = _local_grad(p.grad.detach())
        counts = (id(p) in split or mesh.tp_rank == 0) and (dp_sharded or mesh.dp_rank == 0)
        if counts:
            for part in views.get(id(p), [g]):
                total += part.double().pow(2).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        all_reduce(total, dist.group.WORLD)
    norm = total.sqrt()
    if max_norm > 0 and params:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            g = _local_grad(p.grad)[0]  # a DTensor's local shard is scaled in place
            g.mul_(scale.to(g.dtype))
    return norm
