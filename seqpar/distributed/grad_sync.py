"""Gradient reductions that tensor + sequence parallelism needs after backward.

Under sequence parallelism a LayerNorm (or a row-parallel bias, or a position embedding)
holds the same parameter on every TP rank but sees only this rank's sequence shard, so each
rank's gradient is a partial sum. Those parameters are *SP-replicated*: their gradients must
be summed over the TP group after backward, or the replicas silently drift apart.

Which parameters are SP-replicated is declared by their layers (:mod:`seqpar.sharding`:
``param_layouts()``, or :func:`mark_sp_replicated` for other modules such as norms); layers
declare it only when sequence parallelism is on. Use exactly one of the two ways to sum them:

* :func:`install_sp_grad_hooks` (inside backward, once per model): what ``seqpar.parallelize``
  does, so a parallelized model needs no call in the training loop;
* :func:`sync_sp_replicated_grads` (explicit, after backward and before clipping): for models
  built from seqpar's layers by hand, and seqpar's own ``GPT`` / Trainer.

Each hooked parameter is recorded on its module, so calling :func:`sync_sp_replicated_grads`
on a model whose gradients the hooks already sum (or installing the hooks twice) raises instead
of summing twice.

Grouped-query attention with fewer key/value heads than TP ranks (``g < t``) replicates each
key/value head over the ``t/g`` ranks whose query heads use it. Each of those ranks' weight
gradients of the head is a partial sum (its own query heads only); :func:`replica_grad_sum`
sums them inside backward, at the weight, so every consumer -- gradient accumulation, FSDP2's
reduce-scatter of the unsharded gradient, pipeline stages, recompute -- sees the full gradient
and nothing after backward needs to know. (The input gradient needs nothing: each rank's
partial key/value gradient times the shared weight is already its share of the TP sum.)
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .layouts import ParamLayout, mark_sp_replicated, module_layouts, sp_replicated_parameters
from .collectives import ProcessGroup, all_reduce, group_rank, group_size

HOOKED = "_seqpar_sp_grad_hooked"  # on a module: {own parameter name: id(parameter)} of those with a TP-sum hook


def _sp_replicated_own(model: nn.Module) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    """(qualified name, module, own name, parameter) of every SP-replicated parameter, each once."""
    out, seen = [], set()
    for mname, module in model.named_modules():
        layouts = module_layouts(module)
        for pname, p in module.named_parameters(recurse=False):
            if layouts[pname].sp_replicated and id(p) not in seen:
                seen.add(id(p))
                out.append((f"{mname}.{pname}" if mname else pname, module, pname, p))
    return out


def hooked_parameters(model: nn.Module) -> list[str]:
    """Names of ``model``'s parameters whose gradients a hook from :func:`install_sp_grad_hooks`
    sums over TP inside backward (empty when none is installed)."""
    # matched by identity: a deep copy of the model gets fresh parameters and none of their hooks
    return [n for n, module, own, p in _sp_replicated_own(model) if module.__dict__.get(HOOKED, {}).get(own) == id(p)]


def _refuse_double_sum(model: nn.Module, what: str) -> None:
    hooked = hooked_parameters(model)
    if hooked:
        shown = ", ".join(hooked[:4]) + (f" and {len(hooked) - 4} more" if len(hooked) > 4 else "")
        raise ValueError(
            f"{what}: the gradients of {shown} are already summed over TP inside backward by hooks from "
            f"install_sp_grad_hooks (seqpar.parallelize installs them); summing again would double them. "
            f"Use one of the two: drop this call (a parallelized model needs none), or remove the hooks "
            f"(.remove() the handles install_sp_grad_hooks returned) and sync explicitly")


def sync_sp_replicated_grads(model: nn.Module, tp_group: ProcessGroup | None) -> int:
    """All-reduce (sum) the gradients of SP-replicated parameters over TP, coalesced into one
    flat buffer. Call after backward, before clipping and the optimizer step, on every rank.
    Returns the number of parameters reduced. Raises ``ValueError`` when hooks from
    :func:`install_sp_grad_hooks` already sum them (a model from ``seqpar.parallelize``)."""
    _refuse_double_sum(model, "sync_sp_replicated_grads")
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


class GradHookHandle:
    """One parameter's TP-sum hook; :meth:`remove` takes it off and forgets it on its module."""

    def __init__(self, handle, module: nn.Module, name: str) -> None:
        self.handle, self.module, self.name = handle, module, name

    def remove(self) -> None:
        self.handle.remove()
        self.module.__dict__.get(HOOKED, {}).pop(self.name, None)


def install_sp_grad_hooks(model: nn.Module, tp_group: ProcessGroup | None) -> list[GradHookHandle]:
    """Drop-in variant: all-reduce each SP-replicated parameter's incoming gradient over TP
    inside backward (a tensor hook, before accumulation into ``.grad``), so no explicit call is
    needed and gradient accumulation over micro-batches stays correct. Returns the hook handles
    (``.remove()`` them to uninstall). Frozen parameters (``requires_grad=False``) get none.
    Installing twice on the same parameters raises, and so does :func:`sync_sp_replicated_grads`
    while the hooks are installed."""
    if group_size(tp_group) == 1:
        return []
    _refuse_double_sum(model, "install_sp_grad_hooks")

    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        all_reduce(grad, tp_group)
        return grad

    handles = []
    for _, module, own, p in _sp_replicated_own(model):
        if not p.requires_grad:  # frozen: no gradient to sum (unfrozen later, it needs a fresh install)
            continue
        module.__dict__.setdefault(HOOKED, {})[own] = id(p)  # a plain attribute, like the layout marks
        handles.append(GradHookHandle(p.register_hook(hook), module, own))
    return handles


def sum_over_replicas(grad: torch.Tensor, layout: ParamLayout, group: ProcessGroup | None) -> torch.Tensor:
    """``grad`` (this rank's local gradient of a parameter laid out by ``layout``) with every
    replicated piece summed over the ranks sharing it. One all-reduce over TP per replica count:
    each rank writes its piece into the slot of its replica set in a zero buffer of one slot per
    piece, so the sum of slot ``j`` is the sum over exactly the ranks holding piece ``j`` (no
    subgroups to create; ``parts`` times the piece's bytes on the wire)."""
    t, rank = group_size(group), group_rank(group)
    if not layout.is_replicated(t):
        return grad
    dim = layout.split_dim
    sizes = [n for _, n, _ in layout.blocks(grad.shape[dim], rank, t)]
    pieces = list(grad.split(sizes, dim))
    reps = layout.replicas(t)
    for rep in sorted({r for r in reps if r > 1}):
        cs = [c for c, r in enumerate(reps) if r == rep]
        flat = torch.cat([pieces[c].reshape(-1) for c in cs])
        slots = flat.new_zeros(t // rep, flat.numel())  # [pieces, numel]
        slots[rank // rep] = flat
        all_reduce(slots, group)
        for c, summed in zip(cs, slots[rank // rep].split([pieces[c].numel() for c in cs])):
            pieces[c] = summed.view_as(pieces[c])
    return torch.cat(pieces, dim)


class _ReplicaGradSum(torch.autograd.Function):
    """Identity forward; backward sums the replicated pieces of the gradient over the TP ranks
    that share them (:func:`sum_over_replicas`)."""

    @staticmethod
    def forward(ctx, param, layout, group):
        ctx.layout, ctx.group = layout, group
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad):
        return sum_over_replicas(grad.contiguous(), ctx.layout, ctx.group), None, None


def replica_grad_sum(param: torch.Tensor | None, layout: ParamLayout, group: ProcessGroup | None):
    """``param`` as it enters the layer's computation: itself when ``layout`` has no replicas
    over ``group`` (or it is frozen), else an identity whose backward sums the replicated
    pieces' gradients over the ranks sharing them. Layers call it on each weight and bias in
    forward."""
    if param is None or not param.requires_grad or not layout.is_replicated(group_size(group)):
        return param
    return _ReplicaGradSum.apply(param, layout, group)


__all__ = ["replica_grad_sum", "sum_over_replicas", "mark_sp_replicated", "sp_replicated_parameters", "sync_sp_replicated_grads", "install_sp_grad_hooks",
           "hooked_parameters", "GradHookHandle"]
