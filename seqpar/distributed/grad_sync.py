"""Gradient reductions that tensor + sequence parallelism needs after backward.

Under sequence parallelism a LayerNorm (or a row-parallel bias, or a position embedding)
holds the same parameter on every TP rank but sees only this rank's sequence shard, so each
rank's gradient is a partial sum. Those parameters are *SP-replicated*: their gradients must
be summed over the TP group after backward, or the replicas silently drift apart.

One mechanism marks them: a module lists the names of its own SP-replicated parameters in
the attribute ``sp_replicated_params`` (set with :func:`mark_sp_replicated`). Layers set it
only when sequence parallelism is on; without SP the gradients are already complete.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from .collectives import ProcessGroup, all_reduce, group_size

ATTR = "sp_replicated_params"


def mark_sp_replicated(module: nn.Module, names: Iterable[str] | None = None) -> nn.Module:
    """Declare ``module``'s own parameters ``names`` (default: all of them) SP-replicated."""
    own = dict(module.named_parameters(recurse=False))
    names = tuple(own) if names is None else tuple(names)
    unknown = [n for n in names if n not in own]
    if unknown:
        raise ValueError(f"{type(module).__name__} has no parameters {unknown}; it has {sorted(own)}")
    setattr(module, ATTR, tuple(sorted(set(getattr(module, ATTR, ())) | set(names))))
    return module


def sp_replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All SP-replicated parameters of ``model``, in a deterministic (module) order, deduplicated."""
    seen: set[int] = set()
    out: list[nn.Parameter] = []
    for module in model.modules():
        for name in getattr(module, ATTR, ()):
            p = getattr(module, name)
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def is_sp_replicated(model: nn.Module) -> set[int]:
    """``id()`` of every SP-replicated parameter (for TP-aware gradient norms)."""
    return {id(p) for p in sp_replicated_parameters(model)}


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
