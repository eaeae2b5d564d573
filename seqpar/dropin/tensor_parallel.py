"""Tensor + sequence parallelism applied to an existing model from outside, by a declarative plan.

:func:`parallelize` works in a fixed order: check the whole plan against the model (on every
rank, before any collective) -> swap the named ``nn.Linear`` / ``nn.Embedding`` / GPT-2 ``Conv1D``
modules for seqpar layers holding this rank's slice of the original weights -> re-tie shared
weights -> tag norm parameters SP-replicated and hook their TP gradient reduction -> divide
per-rank head counts -> give dropout its RNG streams (:mod:`.dropout`) -> hook the
sequence-parallel region's entry and exit (:mod:`.modes`).

``Plan.seq_dim`` names the sequence dim of the hidden states (1 for batch-first ``[b, s, h]``
models such as Hugging Face's). Under SP the region between
``Plan.sp_start``'s input and ``Plan.sp_end``'s output holds ``[b, s/t, h]`` shards: norms,
dropouts and residual adds there touch ``1/t`` of the tokens. Column layers all-gather the
sequence (the paper's g) and row layers reduce-scatter it back (g-bar) inside their matmuls, or
the g runs once on entry to an ``enter_tp`` module for all the column layers inside it.
Everything outside that region (embeddings, masks, rotary tables, the LM head and loss) sees full
sequences, so a model's own bookkeeping of positions and mask shapes keeps working.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import ProcessGroup, check_group, group_size
from ..distributed.mesh import ParallelMesh
from ..errors import UserError
from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, skip_init
from .dropout import check_dropout, install_streams
from .kv_heads import check_kv, kv_groups, set_kv_attrs
from .modes import check_groups, check_sp_plan, install_mode
from .spec import KINDS, SPLIT, Parallelized, Plan, Style
from .wrappers import _is_fsdp, unwrap


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


def _check_module(name: str, m: nn.Module, style: Style, t: int, groups: tuple[int] | None = None) -> list[str]:
    linear = isinstance(m, nn.Linear) or _is_conv1d(m)
    if style.kind in ("column", "row") and not linear:
        return [f"{name} ({style.kind}) must be nn.Linear or Conv1D, got {type(m).__name__}"]
    if style.kind == "vocab" and not (linear or isinstance(m, nn.Embedding)):
        return [f"{name} (vocab) must be nn.Embedding, nn.Linear or Conv1D, got {type(m).__name__}"]
    if style.kind not in SPLIT:
        return check_dropout(name, m, style)
    if isinstance(m, nn.Embedding):
        errors = [f"{name}: vocabulary {m.num_embeddings} not divisible by t={t}"] if m.num_embeddings % t else []
        return errors + ([f"{name}: max_norm / sparse embeddings are not supported"] if m.max_norm or m.sparse else [])
    out, inp = _linear_dense(m)[0].shape
    if style.kind == "row":
        return [f"{name} (row): in_features {inp} not divisible by t={t}"] if inp % t else []
    if groups is not None:  # key/value heads fewer than t: whole heads, each on t/g ranks
        return [f"{name} ({style.kind}): out_features {out} not divisible by its {groups[0]} heads"] if out % groups[0] \
            else []
    if out % (style.chunks * t):
        return [f"{name} ({style.kind}): out_features {out} not divisible by t={t} x chunks={style.chunks}"]
    return []


def _check(model: nn.Module, plan: Plan, t: int, sp: bool) -> dict[str, Style]:
    """Resolve the plan to ``{module name: Style}``; raise one ValueError listing every problem."""
    errors, resolved = [], {}
    where = type(model).__name__
    kv = _kv_names(model, plan, t)
    for pattern, value in plan.layers.items():
        style, names = _style(value, pattern), _matches(model, pattern)
        if not names:
            errors.append(f"plan entry {pattern!r} matches no module of {where}")
        for name in names:
            m = model.get_submodule(name)
            if name in resolved:
                errors.append(f"{name} is named by more than one plan entry")
            resolved[name] = style
            errors += _check_module(name, m, style, t, kv.get(name))
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
    errors += check_kv(model, plan, t)
    errors += check_sp_plan(model, plan) if sp else []
    if errors:
        raise ValueError("parallelize: " + "; ".join(errors))
    return resolved


class _GatheredColumn(ColumnParallelLinear):
    """Column-parallel layer inside an ``enter_tp`` module: its input was gathered (SP) or copied
    (plain TP) once on entry, so only the local matmul runs here. Its input gradient is this
    rank's partial sum, completed by the entry's reduce-scatter (all-reduce)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x, self.in_features)
        return F.linear(x, *self.summed_params())  # [b, s, in] -> [b, s, out/t]

    def _get_name(self) -> str:  # printed as what it is to the user: a column-parallel layer
        return "ColumnParallelLinear"

    def extra_repr(self) -> str:
        return super().extra_repr() + ", input gathered on entry to the enclosing enter_tp module"


def _kv_names(model: nn.Module, plan: Plan, t: int) -> dict[str, tuple[int]]:
    """Key/value column layers whose heads are fewer than ``t`` -> the ``groups`` they declare."""
    groups = kv_groups(model, plan, t) if plan.kv is not None and not check_kv(model, plan, t) else None
    if groups is None:
        return {}
    return {name: groups for pattern in plan.kv.layers for name in _matches(model, pattern)}


def _build(m: nn.Module, style: Style, group: ProcessGroup | None, entered: bool,
           groups: tuple[int] | None = None) -> nn.Module:
    """The seqpar layer holding this rank's slice of ``m``'s weights (its sequence-parallel mode
    and ``seq_dim`` are set afterwards, by :func:`~seqpar.dropin.modes.install_mode`)."""
    if isinstance(m, nn.Embedding):
        new = VocabParallelEmbedding.from_dense(m, tp_group=group, sequence_parallel=False)
        if m.padding_idx is not None:  # padding rows get no gradient from the lookup, as in nn.Embedding
            pad = m.padding_idx % m.num_embeddings
            new.register_forward_hook(lambda mod, args, out: torch.where((args[0] == pad).unsqueeze(-1),
                                                                         out.detach(), out))
        return new
    w, b = _linear_dense(m)
    out_f, in_f = w.shape
    kw = dict(bias=b is not None, tp_group=group, dtype=w.dtype, device=w.device, init_method=skip_init)
    if groups is not None:
        kw["groups"] = groups  # whole key/value heads, each replicated over t/g ranks
    if style.kind == "row":
        new = RowParallelLinear(in_f, out_f, **kw)
    elif entered and style.kind == "column":
        new = _GatheredColumn(in_f, out_f, chunks=style.chunks, **kw)
    else:
        new = ColumnParallelLinear(in_f, out_f, gather_output=style.kind == "vocab", chunks=style.chunks, **kw)
    new.load_dense(w, b)  # the layer's layout puts each rank's part of every chunk together
    return new


def _refuse_wrapped(model: nn.Module) -> None:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DistributedDataParallel, DataParallel)) or _is_fsdp(model):
        raise ValueError(f"parallelize: the model is wrapped in {type(model).__name__}, which holds the parameters "
                         f"parallelize replaces; parallelize first, then wrap (TP, recompute, compile, data parallel)")
    if getattr(model, "seqpar", None) is not None:
        raise ValueError("parallelize: this model has already been parallelized")


def _swap(model: nn.Module, resolved: dict[str, Style], group: ProcessGroup | None,
          kv: dict[str, tuple[int]]) -> dict[str, tuple[Style, bool]]:
    """Replace every split module by its seqpar layer; keep ``requires_grad`` and weight ties."""
    entries = _entries(resolved)
    swapped: dict[str, tuple[Style, bool]] = {}
    ties: dict[int, nn.Parameter] = {}  # original weight -> its first replacement
    for name, style in resolved.items():
        if style.kind not in SPLIT:
            continue
        m = model.get_submodule(name)
        new = _build(m, style, group, _entered(name, entries), kv.get(name))
        for p_new, p_old in zip(new.parameters(), m.parameters()):
            p_new.requires_grad_(p_old.requires_grad)  # frozen weights stay frozen
        if id(m.weight) in ties:  # re-tie what the original modules shared (embedding <-> LM head)
            new.weight = ties[id(m.weight)]
        ties.setdefault(id(m.weight), new.weight)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
        swapped[name] = (style, _is_conv1d(m))
    return swapped


def _refuse_save_pretrained(*args, **kwargs):
    raise ValueError("save_pretrained on a model parallelized by seqpar would write this rank's shards of the "
                     "weights; call seqpar.dropin.save_pretrained(model, path) on every rank instead (it gathers "
                     "the full weights and writes them, with the config, from rank 0)")


def _check_arguments(model, plan, mesh, seed) -> None:
    """``parallelize``'s arguments are of the types it takes (an error naming the argument)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise UserError(f"parallelize(seed=...): seed must be an int in [0, 2**63), got {seed!r}")
    for name, value, types, want in (("model", model, nn.Module, "a torch.nn.Module"),
                                     ("plan", plan, (Plan, dict), "a Plan or a dict {pattern: style} "
                                      "(seqpar.plans.gpt2(), seqpar.plans.llama())"),
                                     ("mesh", mesh, (ParallelMesh, type(None)), "a ParallelMesh "
                                      "(seqpar.init_parallel) or None")):
        if not isinstance(value, types):
            raise UserError(f"parallelize({name}=...): {name} must be {want}, got {type(value).__name__}")


def parallelize(model: nn.Module, plan: Plan | dict[str, str | Style], mesh: ParallelMesh | None, *,
                sequence_parallel: bool = True, seed: int = 0) -> nn.Module:
    """Apply ``plan`` to ``model`` in place over ``mesh``'s TP group and return it.

    With no mesh (or ``t == 1``) the modules are still swapped (plain single-rank layers) and no
    hooks are installed, so the same code runs unparallelised. A plan naming missing modules, a
    wrong module type or a size ``t`` does not divide raises ``ValueError`` before anything changes.
    Frozen parameters stay frozen, buffers stay as they are. Dropout the plan places (its
    ``"sequence"`` ``nn.Dropout`` s, the attention core of its ``heads`` modules) draws from RNG
    streams seeded by ``seed`` (``model.seqpar.streams``): per TP rank on sequence shards and
    heads, alike on every rank on full tensors; other dropout keeps torch's default generator
    (seed every rank alike) (:mod:`seqpar.dropin.dropout`). A ``torch.compile``d model is
    parallelized inside its wrapper; DDP / FSDP must come after parallelize. The model's own
    ``save_pretrained`` (Hugging Face) is replaced by an error pointing to
    :func:`seqpar.dropin.save_pretrained`, which gathers the weights first.
    """
    _check_arguments(model, plan, mesh, seed)
    plan = plan if isinstance(plan, Plan) else Plan(layers=dict(plan))
    _refuse_wrapped(model)
    inner = unwrap(model)
    _refuse_wrapped(inner)
    group = None if mesh is None else mesh.tp_group
    check_group(group, "parallelize")
    t = group_size(group)
    sp = bool(sequence_parallel) and t > 1
    resolved = _check(inner, plan, t, sp)
    check_groups(inner, mesh)  # seqpar layers the model already holds must use the same TP group
    swapped = _swap(inner, resolved, group, _kv_names(inner, plan, t))
    for pattern, attrs in plan.heads.items():
        for name in _matches(inner, pattern):
            m = inner.get_submodule(name)
            for a in attrs:
                if isinstance(getattr(m, a, None), int):
                    setattr(m, a, getattr(m, a) // t)  # this rank's heads / width
    set_kv_attrs(inner, plan, t, _matches)
    state = Parallelized(group, t, sp, swapped, plan=plan, resolved=resolved)
    state.streams = install_streams(inner, state, mesh, seed, [n for p in plan.heads for n in _matches(inner, p)])
    install_mode(inner, state)
    inner.seqpar = state
    if hasattr(inner, "save_pretrained"):
        inner.save_pretrained = _refuse_save_pretrained  # an instance attribute; the class is untouched
    return model


__all__ = ["Style", "Plan", "Parallelized", "parallelize"]
