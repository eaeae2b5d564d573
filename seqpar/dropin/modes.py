"""The sequence-parallel mode of a parallelized model: region hooks, norm tags, gradient hooks.

Under SP the hidden states entering ``Plan.sp_start`` are split into sequence shards and the
output of ``Plan.sp_end`` is gathered back; ``enter_tp`` modules gather their input once (g);
norms are tagged SP-replicated and their gradients summed over TP by hooks; the plan's dropouts
draw from the per-TP-rank stream (:mod:`.dropout`). Without SP the
``enter_tp`` modules only copy their input into the TP region (f) and nothing else is hooked.
:func:`set_sequence_parallel` switches an already-parallelized model between the two (SP for
training, plain TP for generation with a KV cache, one token per step), exactly as if
``parallelize`` had been called with the other ``sequence_parallel``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from .. import sharding
from ..distributed.collectives import ProcessGroup, group_ranks, group_size
from ..distributed.grad_sync import install_sp_grad_hooks, mark_sp_replicated
from ..distributed.mesh import ParallelMesh
from ..distributed.regions import copy_to_tp, gather_from_sp, gather_to_replicated, scatter_to_sp
from .dropout import set_dropout_streams
from .spec import Parallelized, Plan
from .wrappers import parallelized, unwrap


def _on_input(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """Forward pre-hook applying ``fn`` to a module's hidden states (first positional argument
    or ``hidden_states=``)."""
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return hook


def _scatter(plan: Plan, group: ProcessGroup | None, t: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """SP entry: ``[b, s, h] -> [b, s/t, h]``, or an error naming the length, t and the switch."""
    dim = plan.seq_dim

    def enter(x: torch.Tensor) -> torch.Tensor:
        if x.dim() > dim and x.shape[dim] % t:
            raise ValueError(
                f"sequence parallelism: sequence length {x.shape[dim]} (seq_dim={dim} of the hidden states "
                f"{tuple(x.shape)} entering {plan.sp_start}) is not divisible by t={t}; pad the batch to a "
                f"multiple of {t}, or switch sequence parallelism off with "
                f"seqpar.dropin.set_sequence_parallel(model, False) (generation with a KV cache needs it off)")
        return scatter_to_sp(x, group, dim)
    return enter


def _region_hooks(model: nn.Module, state: Parallelized, entries: list[str]) -> list:
    """Region boundaries: SP entry (scatter) and exit (gather), and every ``enter_tp`` entry."""
    plan, group, sp, handles = state.plan, state.tp_group, state.sequence_parallel, []
    if state.tp_size == 1:
        return handles
    if sp:
        dim = plan.seq_dim
        handles.append(model.get_submodule(plan.sp_start).register_forward_pre_hook(
            _on_input(_scatter(plan, group, state.tp_size)), with_kwargs=True))  # [b, s, h] -> [b, s/t, h]

        def leave(module, args, out):  # [b, s/t, h] -> [b, s, h]
            if isinstance(out, tuple):
                return (gather_to_replicated(out[0], group, dim), *out[1:])
            return gather_to_replicated(out, group, dim)
        handles.append(model.get_submodule(plan.sp_end).register_forward_hook(leave))
    enter = (lambda x: gather_from_sp(x, group, plan.seq_dim)) if sp else (lambda x: copy_to_tp(x, group))  # g / f
    for name in entries:
        handles.append(model.get_submodule(name).register_forward_pre_hook(_on_input(enter), with_kwargs=True))
    return handles


def _norms(model: nn.Module, state: Parallelized) -> list[nn.Module]:
    return [model.get_submodule(n) for n, st in state.resolved.items()
            if st.kind == "sequence" and any(True for _ in model.get_submodule(n).parameters(recurse=False))]


def install_mode(model: nn.Module, state: Parallelized) -> None:
    """Tag, hook and set every swapped layer and stream dropout for ``state.sequence_parallel``
    (nothing installed yet)."""
    sp = state.sequence_parallel
    for name, (style, _) in state.swapped.items():
        layer = model.get_submodule(name)
        if style.kind in ("column", "row"):
            layer.sequence_parallel = sp
            layer.seq_dim = state.plan.seq_dim if state.plan.seq_dim is not None else 0
    for norm in _norms(model, state) if sp else ():
        mark_sp_replicated(norm)
    set_dropout_streams(model, state)
    entries = [n for n, st in state.resolved.items() if st.kind == "enter_tp"]
    state.grad_handles = install_sp_grad_hooks(model, state.tp_group)
    state.handles = _region_hooks(model, state, entries)


def remove_mode(model: nn.Module, state: Parallelized) -> None:
    """Undo :func:`install_mode`: every hook off, the norms' SP-replicated tags removed."""
    for h in state.handles + state.grad_handles:
        h.remove()
    state.handles, state.grad_handles = [], []
    for norm in _norms(model, state):
        norm.__dict__.pop(sharding.ATTR, None)


def check_sp_plan(model: nn.Module, plan: Plan) -> list[str]:
    """Problems that keep ``plan`` from running ``model`` sequence-parallel (empty when none)."""
    where, errors = type(model).__name__, []
    for role in ("sp_start", "sp_end"):
        p = getattr(plan, role)
        if p is None or len([n for n, _ in model.named_modules() if n == p]) != 1:
            errors.append(f"sequence_parallel=True needs plan.{role} naming exactly one module of {where} "
                          f"(a boundary of the sequence-sharded region), got {p!r}")
    if not isinstance(plan.seq_dim, int) or isinstance(plan.seq_dim, bool) or plan.seq_dim < 0:
        errors.append(f"sequence_parallel=True needs plan.seq_dim, the sequence dim of the hidden states "
                      f"(1 for batch-first [b, s, h], 0 for [s, b, h]), got {plan.seq_dim!r}")
    return errors


def set_sequence_parallel(model: nn.Module, enabled: bool) -> nn.Module:
    """Switch a parallelized model's sequence parallelism on or off in place; returns ``model``.

    Off, the model runs as plain TP on any sequence length (generation with a KV cache, one
    token per step); on, norms, dropouts and residual adds run on ``[b, s/t, h]`` shards again.
    Weights, optimizer state and hooks on other modules are untouched; the result is the model
    ``parallelize(..., sequence_parallel=enabled)`` would have built. A no-op at ``t == 1``.
    """
    inner, state = parallelized(model, "set_sequence_parallel")
    sp = bool(enabled) and state.tp_size > 1
    if sp == state.sequence_parallel:
        return model
    errors = check_sp_plan(inner, state.plan) if sp else []
    if errors:
        raise ValueError("set_sequence_parallel: " + "; ".join(errors))
    remove_mode(inner, state)
    state.sequence_parallel = sp
    install_mode(inner, state)
    return model


def _ranks(group: ProcessGroup | None) -> list[int]:
    if group_size(group) == 1:
        return group_ranks(None)
    return sorted(group_ranks(group))


def check_groups(model: nn.Module, mesh: ParallelMesh | None) -> None:
    """Raise ``ValueError`` listing the seqpar layers of ``model`` that run sequence-parallel over
    a group other than ``mesh``'s TP group (e.g. a one-rank or data-parallel group on input that
    was split over TP): they would compute on this rank's shard alone. No communication."""
    want = _ranks(None if mesh is None else mesh.tp_group)
    bad = []
    for name, m in unwrap(model).named_modules():
        if getattr(m, "sequence_parallel", False) and hasattr(m, "tp_group") and hasattr(m, "param_layouts"):
            have = _ranks(m.tp_group)
            if have != want:
                bad.append(f"{name or type(m).__name__} (group of ranks {have})")
    if bad:
        raise ValueError(f"check_groups: {len(bad)} sequence-parallel layer(s) use a group other than the mesh's TP "
                         f"group (ranks {want}): {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}; build them "
                         f"with tp_group=mesh.tp_group, or with sequence_parallel=False if they are meant "
                         f"to run replicated")


__all__ = ["set_sequence_parallel", "check_groups", "check_sp_plan", "install_mode", "remove_mode"]
