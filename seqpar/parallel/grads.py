"""Gradients across parallel ranks: the tied token table over stages, and the one global-norm clip.

:func:`clip_grad_norm` is the clip of every layout. It counts each element of the full model's
gradient exactly once, reading the layouts (:mod:`seqpar.sharding`) instead of re-deriving them:

* tp: a TP-split parameter's squares are summed over the TP group; a parameter replicated over TP
  (norms, row-parallel biases, positions; SP-replicated ones after their TP sum) is counted on TP
  rank 0 only.
* dp: an FSDP2 gradient (a DTensor holding this rank's dp shard) is summed over dp; a gradient
  replicated over dp (ddp, pipelines) is counted on dp rank 0 only; an expert's gradient (experts
  split over ep, carved from dp x cp) on the first rank of its expert-data-parallel group, summed
  over all dp x cp ranks.
* pp: every stage holds other parameters, so squares are summed over pp; a tied copy another
  stage counts (the last stage's token table) is passed in ``exclude``.

With tied embeddings and ``p > 1`` the first stage (lookup) and the last stage (output layer)
each hold a copy of ``wte.weight``; after backward both copies' gradients are summed over the
pair, once, so the copies stay equal (:func:`sum_tied_grads`). A split parameter's pieces replicated over TP (grouped-query
key/value heads at ``g < t``) count once, on the first rank sharing them (:func:`replica_views`).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, all_reduce, group_rank, group_size, new_group
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
        group = new_group([j, (p - 1) * stage + j])
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


def _dp_sharded(grad: torch.Tensor) -> bool:
    """A DTensor gradient is FSDP2's: this rank holds one dp shard of it."""
    return local_tensor(grad) is not grad


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


def counted_here(module: nn.Module, *, tp_group: ProcessGroup | None = None, dp_group: ProcessGroup | None = None,
                 exclude: Iterable[nn.Parameter] = (), experts: Iterable[nn.Parameter] = (),
                 expert_dp_group: ProcessGroup | None = None) -> list[nn.Parameter]:
    """The parameters (with a gradient) whose local squares this rank adds to the global norm,
    each once: see the module docstring. ``experts`` (split over ep inside dp) count on the first
    rank of ``expert_dp_group`` instead of dp's. Pure: reads layouts and ranks, no collective."""
    skip, expert_ids = {id(p) for p in exclude}, {id(p) for p in experts}
    split = split_parameters(module) if group_size(tp_group) > 1 else set()
    tp_first, dp_first = group_rank(tp_group) == 0, group_rank(dp_group) == 0
    edp_first = group_rank(expert_dp_group) == 0
    seen, out = set(), []
    for p in module.parameters():
        if p.grad is None or id(p) in skip or id(p) in seen:
            continue
        seen.add(id(p))
        first = edp_first if id(p) in expert_ids else dp_first
        if (id(p) in split or tp_first) and (_dp_sharded(p.grad) or first):
            out.append(p)
    return out


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squares of ``grads`` as a float64 scalar on ``device``: per-tensor norms by
    ``torch._foreach_norm`` in at least fp32, squared and summed on the device (no host sync)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    acc = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads]
    return torch.stack(torch._foreach_norm(acc)).double().pow(2).sum()


@torch.no_grad()
def scale_grads_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Multiply ``grads`` in place by the 0-dim device tensor ``scale``, one foreach per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, gs in by_dtype.items():
        torch._foreach_mul_(gs, scale.to(dtype))


@torch.no_grad()
def clip_grad_norm(module: nn.Module, max_norm: float, *, tp_group: ProcessGroup | None = None,
                   dp_group: ProcessGroup | None = None, pp_group: ProcessGroup | None = None,
                   exclude: Iterable[nn.Parameter] = (), device: torch.device | str | None = None,
                   experts: Iterable[nn.Parameter] = (), expert_dp_group: ProcessGroup | None = None,
                   data_group: ProcessGroup | None = None, split_experts: bool | None = None) -> torch.Tensor:
    """Global L2 norm of the full model's gradients from this rank's part ``module``, over every
    layout at once (tp splits, FSDP2 dp shards, pp stages, tied copies in ``exclude`` and
    replicated parameters counted once). Scales every gradient of ``module`` in place by
    ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0``. Returns the norm before
    clipping, a float64 0-dim tensor on the grads' device, identical on every rank. A
    collective over each non-trivial group of ``tp_group``, ``dp_group``, ``pp_group``
    (one scalar each); no host sync. ``split_experts``: sum the experts' part over ``data_group``
    (default: when this rank has ``experts``); pipeline stages pass the same value on every stage,
    since a stage without experts must still join the part's sum over pp."""
    grads = [local_tensor(p.grad) for p in module.parameters() if p.grad is not None]
    device = grads[0].device if grads else torch.device(device or "cpu")
    experts = list(experts)
    counted = counted_here(module, tp_group=tp_group, dp_group=dp_group, exclude=exclude, experts=experts,
                           expert_dp_group=expert_dp_group)
    views = replica_views(module, group_rank(tp_group), group_size(tp_group)) if group_size(tp_group) > 1 else {}
    split = {id(p) for p in experts}
    squares = lambda ps: _sum_of_squares([v for p in ps for v in views.get(id(p), [local_tensor(p.grad)])],  # noqa: E731
                                         device)
    total = squares([p for p in counted if id(p) not in split])
    for group in (tp_group, dp_group, pp_group):
        all_reduce(total, group)
    if bool(experts) if split_experts is None else split_experts:  # split over ep inside dp x cp: ``data_group``
        part = squares([p for p in counted if id(p) in split])
        for group in (tp_group, data_group, pp_group):
            all_reduce(part, group)
        total += part
    norm = total.sqrt()
    if max_norm > 0 and grads:
        scale_grads_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
    return norm


__all__ = ["clip_grad_norm", "counted_here", "replica_views", "scale_grads_", "sum_tied_grads", "tied_embedding_group"]
