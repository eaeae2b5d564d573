"""Gradient reductions that tensor + sequence parallelism needs after backward.

Under sequence parallelism a LayerNorm (or a row-parallel bias, or a position embedding)
holds the same parameter on every TP rank but sees only this rank's sequence shard, so each
rank's gradient is a partial sum. Those parameters are *SP-replicated*: their gradients must
be summed over the TP group after backward, or the replicas silently drift apart.

Which parameters are SP-replicated is declared by their layers (:mod:`seqpar.sharding`:
``param_layouts()``, or :func:`mark_sp_replicated` for other modules such as norms); layers
declare it only when sequence parallelism is on. Use exactly one of :func:`sync_sp_replicated_grads`
(explicit, after backward) or :func:`install_sp_grad_hooks` (inside backward).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..sharding import mark_sp_replicated, sp_replicated_parameters
from .collectives import ProcessGroup, all_reduce, group_size


def sync_sp_replicated_grads(model: nn.Module, tp_group: ProcessGroup | None) -> int:
    """All-reduce (sum) the gradients of SP-replicated parameters over TP, coalesced into one
    flat buffer. Call after backward, before clipping and the optimizer step, on every rank.
    Returns the number of parameters reduced."""
    if group_size(tp_group) == 1:
        return 0
    params = [p for p in sp_replicated_parameters(model) if p.grad is not None]
    if not params:
        return 0
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for ps in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in ps])
        all_reduce(flat, tp_group)
        offset = 0
        for p in ps:
            n = p.grad.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
    return len(params)


def install_sp_grad_hooks(model: nn.Module, tp_group: ProcessGroup | None) -> list:
    """Drop-in variant: all-reduce each SP-replicated parameter's incoming gradient over TP
    inside backward (a tensor hook, before accumulation into ``.grad``), so no explicit call is
    needed and gradient accumulation over micro-batches stays correct. Returns the hook handles
    (``.remove()`` them to uninstall). Do not combine with :func:`sync_sp_replicated_grads`,
    which would reduce twice."""
    if group_size(tp_group) == 1:
        return []

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        all_reduce(grad, tp_group)
        return grad

    return [p.register_hook(hook) for p in sp_replicated_parameters(model)]
