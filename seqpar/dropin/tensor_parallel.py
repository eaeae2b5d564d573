"""Tensor + sequence parallelism applied to an existing model from outside, by a declarative plan.

:func:`parallelize` works in a fixed order: check the whole plan against the model (on every
rank, before any collective) -> swap the named ``nn.Linear`` / ``nn.Embedding`` / GPT-2 ``Conv1D``
modules for seqpar layers holding this rank's slice of the original weights -> re-tie shared
weights -> tag norm parameters SP-replicated and hook their TP gradient reduction -> divide
per-rank head counts -> hook the sequence-parallel region's entry and exit.

Batch-first models (``[b, s, h]``) shard the sequence along dim 1. Under SP the region between
``Plan.sp_start``'s input and ``Plan.sp_end``'s output holds ``[b, s/t, h]`` shards: norms,
dropouts and residual adds there touch ``1/t`` of the tokens. Column layers all-gather the
sequence (the paper's g) and row layers reduce-scatter it back (g-bar) inside their matmuls, or
the g runs once on entry to an ``enter_tp`` module for all the column layers inside it.
Everything outside that region (embeddings, masks, rotary tables, the LM head and loss) sees full
sequences, so a model's own bookkeeping of positions and mask shapes keeps working.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Literal, get_args

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import ProcessGroup, check_group, group_size
from ..distributed.grad_sync import install_sp_grad_hooks, mark_sp_replicated
from ..distributed.mesh import ParallelMesh
from ..distributed.regions import copy_to_tp, gather_from_sp, gather_to_replicated, scatter_to_sp
from .. import sharding
from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, skip_init

Kind = Literal["column", "row", "vocab", "sequence", "enter_tp"]
KINDS: tuple[str, ...] = get_args(Kind)
SPLIT = ("column", "row", "vocab")  # the kinds that swap a module for a seqpar layer


@dataclass(frozen=True)
class Style:
    """How one module is parallelised.

    ``column``: output features split over TP (``[b, s/t, in]`` SP shard or ``[b, s, in]`` in,
    ``[b, s, out/t]`` out). ``row``: input features split; output all-reduced, or reduce-scattered
    to ``[b, s/t, out]`` under SP. ``vocab``: an ``nn.Embedding`` split by vocabulary rows (output
    all-reduced to ``[b, s, h]``), or an output head split by vocabulary whose logits are
    all-gathered to ``[b, s, v]`` for the model's own loss. ``sequence``: runs on sequence shards
    under SP (norms): its parameters are SP-replicated, gradients summed over TP in backward.
    ``enter_tp``: a module that needs its full-sequence input (one that reshapes by its input's
    shape, like Llama's attention): its hidden states are all-gathered once on entry (g; f without
    SP) and the column layers inside skip their own input communication, so their partial input
    gradients are summed by a single reduce-scatter (all-reduce). Costs the full ``[b, s, h]``
    input kept for the weight gradients instead of the shard.
    """

    kind: Kind
    chunks: int = 1  # column only: the output is `chunks` equal blocks split separately (fused [q; k; v]: 3)


@dataclass(frozen=True, eq=False)
class Plan:
    """Which modules become what. Patterns are dotted module names where ``*`` matches one name
    component (``transformer.h.*.attn.c_attn``); every pattern must match at least one module."""

    layers: dict[str, str | Style]
    heads: dict[str, tuple[str, ...]] = field(default_factory=dict)  # int attributes divided by t where present
    divisible: tuple[str, ...] = ()  # model.config attributes t must divide (head counts)
    sp_start: str | None = None      # its input hidden states are scattered into sequence shards
    sp_end: str | None = None        # its output is all-gathered back to full sequences
    seq_dim: int = 1                 # sequence dim of hidden states (1: batch-first)


@dataclass
class Parallelized:
    """What :func:`parallelize` did, kept on the model as ``model.seqpar`` (for :func:`dense_state_dict`)."""

    tp_group: ProcessGroup | None
    tp_size: int
    sequence_parallel: bool
    swapped: dict[str, tuple[Style, bool]]  # module name -> (style, was a transposed Conv1D)
    handles: list = field(default_factory=list)


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and m.weight.dim() == 2


def _matches(model: nn.Module, pattern: str) -> list[str]:
    rx = re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))  # `*`: one dotted component
    return [n for n, _ in model.named_modules() if rx.fullmatch(n)]


def _entries(resolved: dict[str, Style]) -> list[str]:
    return [n for n, st in resolved.items() if st.kind == "enter_tp"]


def _entered(name: str, entries: list[str]) -> bool:
    """Whether module ``name`` lies inside one of the ``enter_tp`` modules ``entries``."""
    return any(name.startswith(e + ".") or not e for e in entries)


def _linear_dense(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.Linear`` layout ``[out, in]`` weight and bias of a Linear or Conv1D."""
    w = m.weight.detach()
    return (w.t() if _is_conv1d(m) else w), (None if m.bias is None else m.bias.detach())


def _style(value: str | Style, pattern: str) -> Style:
    style = Style(value) if isinstance(value, str) else value
    if not isinstance(style, Style) or style.kind not in KINDS:
        raise ValueError(f"plan entry {pattern!r}: style must be one of {KINDS} or a Style, got {value!r}")
    if style.chunks < 1 or (style.chunks > 1 and style.kind != "column"):
        raise ValueError(f"plan entry {pattern!r}: chunks={style.chunks} is only valid (>= 1) for 'column'")
    return style


def _check_module(name: str, m: nn.Module, style: Style, t: int) -> list[str]:
    linear = isinstance(m, nn.Linear) or _is_conv1d(m)
    if style.kind in ("column", "row") and not linear:
        return [f"{name} ({style.kind}) must be nn.Linear or Conv1D, got {type(m).__name__}"]
    if style.kind == "vocab" and not (linear or isinstance(m, nn.Embedding)):
        return [f"{name} (vocab) must be nn.Embedding, nn.Linear or Conv1D, got {type(m).__name__}"]
    if style.kind not in SPLIT:
        return []
    if isinstance(m, nn.Embedding):
        errors = [f"{name}: vocabulary {m.num_embeddings} not divisible by t={t}"] if m.num_embeddings % t else []
        return errors + ([f"{name}: max_norm / sparse embeddings are not supported"] if m.max_norm or m.sparse else [])
    out, inp = _linear_dense(m)[0].shape
    if style.kind == "row":
        return [f"{name} (row): in_features {inp} not divisible by t={t}"] if inp % t else []
    if out % (style.chunks * t):
        return [f"{name} ({style.kind}): out_features {out} not divisible by t={t} x chunks={style.chunks}"]
    return []


def _check(model: nn.Module, plan: Plan, t: int, sp: bool) -> dict[str, Style]:
    """Resolve the plan to ``{module name: Style}``; raise one ValueError listing every problem."""
    errors, resolved = [], {}
    where = type(model).__name__
    for pattern, value in plan.layers.items():
        style, names = _style(value, pattern), _matches(model, pattern)
        if not names:
            errors.append(f"plan entry {pattern!r} matches no module of {where}")
        for name in names:
            m = model.get_submodule(name)
            if name in resolved:
                errors.append(f"{name} is named by more than one plan entry")
            resolved[name] = style
            errors += _check_module(name, m, style, t)
    shared: dict[int, list[str]] = {}
    for name, st in resolved.items():
        if st.kind in SPLIT:
            shared.setdefault(id(model.get_submodule(name).weight), []).append(name)
    for names in shared.values():
        splits = {(resolved[n].kind == "row", resolved[n].chunks) for n in names}
        if len(splits) > 1:
            errors.append(f"{' and '.join(names)} share one weight but would be split differently")
    for name in _entries(resolved):
        if not any(_entered(n, [name]) for n, st in resolved.items() if st.kind == "column"):
            errors.append(f"{name} (enter_tp) contains no column layer of the plan")
    for pattern, attrs in plan.heads.items():
        names = _matches(model, pattern)
        if not names:
            errors.append(f"plan heads entry {pattern!r} matches no module of {where}")
        for name in names:
            m = model.get_submodule(name)
            errors += [f"{name}.{a} = {getattr(m, a)} not divisible by t={t}" for a in attrs
                       if isinstance(getattr(m, a, None), int) and getattr(m, a) % t]
    config = getattr(model, "config", None)
    for a in plan.divisible:
        v = getattr(config, a, None)
        if isinstance(v, int) and v % t:
            errors.append(f"config.{a} = {v} not divisible by t={t}")
    for role in ("sp_start", "sp_end") if sp else ():
        p = getattr(plan, role)
        if p is None or len(_matches(model, p)) != 1:
            errors.append(f"sequence_parallel=True needs plan.{role} naming exactly one module of {where} "
                          f"(a boundary of the sequence-sharded region), got {p!r}")
    if errors:
        raise ValueError("parallelize: " + "; ".join(errors))
    return resolved


class _GatheredColumn(ColumnParallelLinear):
    """Column-parallel layer inside an ``enter_tp`` module: its input was gathered (SP) or copied
    (plain TP) once on entry, so only the local matmul runs here. Its input gradient is this
    rank's partial sum, completed by the entry's reduce-scatter (all-reduce)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features)
        return F.linear(x, self.weight, self.bias)  # [b, s, in] -> [b, s, out/t]


def _build(m: nn.Module, style: Style, group: ProcessGroup | None, sp: bool, seq_dim: int,
           entered: bool) -> nn.Module:
    """The seqpar layer holding this rank's slice of ``m``'s weights."""
    if isinstance(m, nn.Embedding):
        new = VocabParallelEmbedding.from_dense(m, tp_group=group, sequence_parallel=False, seq_dim=seq_dim)
        if m.padding_idx is not None:  # padding rows get no gradient from the lookup, as in nn.Embedding
            pad = m.padding_idx % m.num_embeddings
            new.register_forward_hook(lambda mod, args, out: torch.where((args[0] == pad).unsqueeze(-1),
                                                                         out.detach(), out))
        return new
    w, b = _linear_dense(m)
    out_f, in_f = w.shape
    kw = dict(bias=b is not None, tp_group=group, dtype=w.dtype, device=w.device, init_method=skip_init,
              seq_dim=seq_dim)
    if style.kind == "row":
        new = RowParallelLinear(in_f, out_f, sequence_parallel=sp, **kw)
        new.load_dense(w, b)
        return new
    if entered and style.kind == "column":
        new = _GatheredColumn(in_f, out_f, chunks=style.chunks, **kw)
    else:
        new = ColumnParallelLinear(in_f, out_f, sequence_parallel=sp and style.kind == "column",
                                   gather_output=style.kind == "vocab", chunks=style.chunks, **kw)
    new.load_dense(w, b)  # the layer's layout puts each rank's part of every chunk together
    return new


def _on_input(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """Forward pre-hook applying ``fn`` to a module's hidden states (first positional argument
    or ``hidden_states=``)."""
    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return hook




def _hooks(model: nn.Module, plan: Plan, entries: list[str], group: ProcessGroup | None, sp: bool) -> list:
    """Region boundaries: SP entry (scatter) and exit (gather), and every ``enter_tp`` entry."""
    dim, handles = plan.seq_dim, []
    if sp:
        handles.append(model.get_submodule(plan.sp_start).register_forward_pre_hook(
            _on_input(lambda x: scatter_to_sp(x, group, dim)), with_kwargs=True))  # [b, s, h] -> [b, s/t, h]

        def leave(module, args, out):  # [b, s/t, h] -> [b, s, h]
            if isinstance(out, tuple):
                return (gather_to_replicated(out[0], group, dim), *out[1:])
            return gather_to_replicated(out, group, dim)
        handles.append(model.get_submodule(plan.sp_end).register_forward_hook(leave))
    enter = (lambda x: gather_from_sp(x, group, dim)) if sp else (lambda x: copy_to_tp(x, group))  # g or f
    for name in entries:
        handles.append(model.get_submodule(name).register_forward_pre_hook(_on_input(enter), with_kwargs=True))
    return handles


def parallelize(model: nn.Module, plan: Plan | dict[str, str | Style], mesh: ParallelMesh | None, *,
                sequence_parallel: bool = True) -> nn.Module:
    """Apply ``plan`` to ``model`` in place over ``mesh``'s TP group and return it.

    With no mesh (or ``t == 1``) the modules are still swapped (plain single-rank layers) and no
    hooks are installed, so the same code runs unparallelised. A plan naming missing modules, a
    wrong module type or a size ``t`` does not divide raises ``ValueError`` before anything changes.
    Dropout in the model keeps drawing from torch's default generator (seed every rank alike).
    """
    plan = plan if isinstance(plan, Plan) else Plan(layers=dict(plan))
    group = None if mesh is None else mesh.tp_group
    check_group(group, "parallelize")
    t = group_size(group)
    sp = bool(sequence_parallel) and t > 1
    if getattr(model, "seqpar", None) is not None:
        raise ValueError("parallelize: this model has already been parallelized")
    resolved = _check(model, plan, t, sp)
    entries = _entries(resolved)

    swapped: dict[str, tuple[Style, bool]] = {}
    ties: dict[int, nn.Parameter] = {}  # original weight -> its first replacement
    for name, style in resolved.items():
        m = model.get_submodule(name)
        if style.kind == "sequence" and sp and any(True for _ in m.parameters(recurse=False)):
            mark_sp_replicated(m)
        if style.kind not in SPLIT:
            continue
        new = _build(m, style, group, sp, plan.seq_dim, _entered(name, entries))
        for p_new, p_old in zip(new.parameters(), m.parameters()):
            p_new.requires_grad_(p_old.requires_grad)
        if id(m.weight) in ties:  # re-tie what the original modules shared (embedding <-> LM head)
            new.weight = ties[id(m.weight)]
        ties.setdefault(id(m.weight), new.weight)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        swapped[name] = (style, _is_conv1d(m))
    for pattern, attrs in plan.heads.items():
        for name in _matches(model, pattern):
            m = model.get_submodule(name)
            for a in attrs:
                if isinstance(getattr(m, a, None), int):
                    setattr(m, a, getattr(m, a) // t)  # this rank's heads / width
    state = Parallelized(group, t, sp, swapped)
    state.handles = install_sp_grad_hooks(model, group) + (_hooks(model, plan, entries, group, sp) if t > 1 else [])
    model.seqpar = state
    return model


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parallelized model's full state dict in the original module layout (Conv1D transposed
    back, fused blocks in their original order), loadable into the unparallelized model.
    A collective: call on every TP rank."""
    state: Parallelized | None = getattr(model, "seqpar", None)
    if state is None:
        raise ValueError("dense_state_dict: the model was not parallelized by seqpar.parallelize")
    params = dict(model.named_parameters())
    dense = sharding.to_dense(model, params, state.tp_group)  # every layout as its layer declares it
    by_id = {id(p): dense[n] for n, p in params.items()}
    out = {k: by_id[id(v)] if id(v) in by_id else v.detach().clone()
           for k, v in model.state_dict(keep_vars=True).items()}
    for name, (_, conv) in state.swapped.items():
        if conv:  # GPT-2's Conv1D stores [in, out]
            key = f"{name}.weight" if name else "weight"
            out[key] = out[key].t().contiguous()
    return out


__all__ = ["Style", "Plan", "Parallelized", "parallelize", "dense_state_dict"]
