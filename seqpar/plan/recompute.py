"""Per-layer recompute under a memory budget: the fewest recomputed FLOPs that fit.

Every layer of a stage costs the same and stores the same, and §4.2.3's in-flight factor applies
to the stage as a whole, so a per-layer choice among none / selective / full is decided by how
many layers of a stage take each mode. The search is exact: for each count of full layers
``k`` (0 .. n) the fewest selective layers that fit is found by bisection (the stage's bytes fall
as layers move from none to selective), and the cheapest pair wins; it stops once ``k`` full
layers alone cost more than the best found. Bytes come from :func:`seqpar.plan.memory.memory_per_gpu`,
the planner's own memory model, so the plan and the search agree by construction.

FLOPs recomputed per layer and micro-batch: selective, the attention core 4bs^2h; full, the whole
forward 24bsh^2 + 4bs^2h (Appendix A; :func:`seqpar.flops.config_layer_forward_flops` for other shapes).

``model.recompute_ops`` (:mod:`seqpar.model.recompute_ops`) are the choices below selective: elementwise
work in every none / selective layer (:func:`op_flops`), tried as every subset of the allowed ones
(:func:`best_choice`; under ``recompute: auto`` those ``model.recompute_ops`` lists); the subset and
mix with the fewest recomputed FLOPs that fit wins, so a budget that no recompute misses by a little
is met by redrawing dropout masks or rebuilding norm outputs before any attention core is recomputed.
"""
from __future__ import annotations

import math
from dataclasses import replace
from itertools import combinations
from pathlib import Path

from ..config import ParallelConfig, RunConfig, TrainConfig
from ..memory.formulas import load_sections
from .. import flops
from ..errors import UserError
from ..model.config import GPTConfig
from ..model.modes import RECOMPUTE_MODES, RECOMPUTE_OPS
from .gpus import GIB
from .layout import Layout, Mode, Recompute
from .memory import memory_per_gpu


def recompute_flops(model: GPTConfig, micro_batch: int) -> dict[Mode, float]:
    """Forward FLOPs one layer repeats in backward for ``micro_batch`` sequences, per mode."""
    core = float(flops.config_core_forward_flops(model, B=micro_batch))
    return {"none": 0.0, "selective": core, "full": float(flops.config_layer_forward_flops(model, B=micro_batch))}


# elementwise FLOPs per element an op-level choice runs again (rough counts: a norm's statistics and
# scaling, the activation's polynomial, one random draw and compare per dropout element)
OP_FLOPS_PER_ELEMENT = {"norm": 8, "activation": 8, "dropout": 2}


def op_flops(model: GPTConfig, micro_batch: int) -> dict[str, float]:
    """Forward FLOPs one none / selective layer repeats in backward per ``model.recompute_ops`` choice:
    two norms and two dropouts over ``[s, b, h]``, the activation over ``[s, b, f]``."""
    sbh = model.seq_len * micro_batch * model.hidden
    width = {"norm": 2 * sbh, "activation": sbh * model.ffn_hidden / model.hidden, "dropout": 2 * sbh}
    return {op: float(OP_FLOPS_PER_ELEMENT[op] * width[op]) for op in RECOMPUTE_OPS}


def _mixed(none: int, selective: int, full: int, ops: tuple[str, ...] = ()) -> Recompute:
    return Recompute("mixed", counts=(("none", none), ("selective", selective), ("full", full)), ops=ops)


def _fewest_selective(fits, n_free: int) -> int | None:
    """Smallest s in [0, n_free] with fits(s), given fits is monotone in s; None if even n_free fails."""
    if not fits(n_free):
        return None
    lo, hi = -1, n_free  # fits(hi) holds
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def best_mix(model: GPTConfig, layout: Layout, budget: float, global_batch: int,
             precision: str = "bf16", ops: tuple[str, ...] = ()) -> Recompute | None:
    """The per-stage mix of none / selective / full with the fewest recomputed FLOPs whose bytes per
    GPU fit ``budget`` (with ``model.recompute_ops`` ``ops`` in the none / selective layers); ``None``
    when even every layer under full recompute does not fit."""
    n = model.layers // layout.pp
    cost = recompute_flops(model, layout.micro_batch)

    def total(none: int, sel: int, full: int) -> float:
        return memory_per_gpu(model, replace(layout, recompute=_mixed(none, sel, full, ops)), budget, global_batch,
                              precision).total

    best: tuple[float, float, Recompute] | None = None
    for full in range(n + 1):
        if best is not None and full * cost["full"] > best[0]:
            break
        sel = _fewest_selective(lambda s: total(n - full - s, s, full) <= budget, n - full)
        if sel is None:
            continue
        key = (sel * cost["selective"] + full * cost["full"], total(n - full - sel, sel, full))
        if best is None or key < best[:2]:
            best = (*key, _mixed(n - full - sel, sel, full, ops))
    return None if best is None else best[2]


def choice_flops(model: GPTConfig, mix: Recompute, micro_batch: int, chunk: int, chunks: int = 1) -> float:
    """FLOPs a stage (``chunks`` model chunks of ``chunk`` layers) recomputes per micro-batch under ``mix``."""
    counts = mix.per_stage(chunk, chunks)
    cost, per_op = recompute_flops(model, micro_batch), op_flops(model, micro_batch)
    kept = counts["none"] + counts["selective"]
    return sum(counts[m] * cost[m] for m in RECOMPUTE_MODES) + kept * sum(per_op[o] for o in mix.ops)


def allowed_ops(model: GPTConfig, ops: tuple[str, ...] = RECOMPUTE_OPS) -> tuple[str, ...]:
    """The ``model.recompute_ops`` choices of ``ops`` that mean something for ``model``: none for MoE
    models (not supported yet), no ``dropout`` without dropout."""
    if model.moe is not None:
        return ()
    return tuple(op for op in ops if op != "dropout" or model.dropout > 0)


def best_choice(model: GPTConfig, layout: Layout, budget: float, global_batch: int, precision: str = "bf16",
                ops: tuple[str, ...] = RECOMPUTE_OPS) -> Recompute | None:
    """:func:`best_mix` over every subset of ``ops`` (``model.recompute_ops`` choices): the mix and
    subset with the fewest recomputed FLOPs (:func:`choice_flops`) that fit ``budget``; fewer ops on a
    tie. ``None`` when nothing fits. With ``ops`` the model's own ``recompute_ops`` are set aside."""
    n = model.layers // layout.pp
    model = replace(model, recompute_ops=()) if ops else model
    best: tuple[float, int, Recompute] | None = None
    for k in range(len(ops) + 1):
        for subset in combinations(ops, k):
            mix = best_mix(model, layout, budget, global_batch, precision, subset)
            if mix is None:
                continue
            mix = mix if mix.per_stage(n)["full"] < n else replace(mix, ops=())  # all full: ops mean nothing
            key = (choice_flops(model, mix, layout.micro_batch, n), len(mix.ops))
            if best is None or key < best[:2]:
                best = (*key, mix)
    return None if best is None else best[2]


def stage_layer_ids(layers: int, pp: int, virtual_stages: int, stage: int) -> list[int]:
    """The model layers stage ``stage`` holds, chunk by chunk (chunk j of stage r holds block j*pp + r)."""
    per = layers // (pp * virtual_stages)
    return [i for j in range(virtual_stages) for i in range((j * pp + stage) * per, (j * pp + stage + 1) * per)]


def layer_modes(recompute: Recompute, layers: int, pp: int = 1, virtual_stages: int = 1) -> list[Mode]:
    """The per-layer list (length ``layers``) of a mix: on every stage, in the order the stage holds
    its layers, the full ones first, then selective, then none (earlier chunks stay in flight longer)."""
    chunk = layers // (pp * virtual_stages)
    counts = recompute.per_stage(chunk, virtual_stages)
    order = [m for m in reversed(RECOMPUTE_MODES) for _ in range(counts[m])]  # full, selective, none
    out: list[Mode] = ["none"] * layers
    for stage in range(pp):
        for mode, layer in zip(order, stage_layer_ids(layers, pp, virtual_stages, stage)):
            out[layer] = mode
    return out


def _smallest(model: GPTConfig, layout: Layout, global_batch: int, precision: str) -> float:
    """The fewest bytes per GPU any per-layer choice needs: memory is linear in the counts of a stage
    except for the backward transient, which depends on whether some layer is full, so the least
    lies on a vertex of one of the two regions."""
    n = model.layers // layout.pp
    vertices = [(n, 0, 0), (0, n, 0), (0, 0, n), (0, n - 1, 1), (n - 1, 0, 1)]
    return min(memory_per_gpu(model, replace(layout, recompute=_mixed(*v)), 1.0, global_batch, precision).total
               for v in vertices)


def auto_recompute_layers(model: GPTConfig, parallel: ParallelConfig, train: TrainConfig, budget_gib: float,
                          precision: str = "bf16", global_batch: int | None = None) -> list[Mode]:
    """``model.recompute: auto`` for loaded config sections: the per-layer modes under ``budget_gib``
    per GPU. The layout is ``parallel.tp/pp/virtual_stages/dp/data_parallel/ep``, ``train.micro_batch``
    and ``model.sequence_parallel``; ``global_batch`` defaults to ``train.global_batch`` or
    ``micro_batch x dp``. Raises :class:`~seqpar.errors.UserError` naming the budget and the
    smallest that fits if nothing does. The model's own ``recompute_ops`` stay as they are
    (:func:`auto_recompute` also chooses them)."""
    return auto_recompute(model, parallel, train, budget_gib, precision, global_batch)[0]


def auto_recompute(model: GPTConfig, parallel: ParallelConfig, train: TrainConfig, budget_gib: float,
                   precision: str = "bf16", global_batch: int | None = None,
                   ops: tuple[str, ...] = ()) -> tuple[list[Mode], tuple[str, ...]]:
    """:func:`auto_recompute_layers` choosing among the ``model.recompute_ops`` ``ops`` too
    (:func:`best_choice`): ``(per-layer modes, chosen ops)``. With ``ops`` empty the model's own
    ``recompute_ops`` are kept (counted in the bytes) and returned."""
    if not (isinstance(budget_gib, (int, float)) and math.isfinite(budget_gib) and budget_gib > 0):
        raise UserError(f"memory budget must be a positive number of GiB, got {budget_gib!r}")
    dp = parallel.dp or 1
    mode = parallel.data_parallel_mode(dp) if hasattr(parallel, "data_parallel_mode") else "ddp"
    layout = Layout(tp=parallel.tp, pp=parallel.pp, dp=dp, virtual_stages=parallel.virtual_stages,
                    micro_batch=train.micro_batch, sequence_parallel=model.sequence_parallel and parallel.tp > 1,
                    data_parallel=mode, ep=getattr(parallel, "ep", 1))  # an MoE rank holds E/ep experts
    batch = global_batch or train.global_batch or train.micro_batch * dp
    mix = best_choice(model, layout, budget_gib * GIB, batch, precision, ops)
    if mix is None:
        need = _smallest(model, layout, batch, precision) / GIB
        where = layout.label().rsplit(" rc=", 1)[0]
        raise UserError(f"memory budget {budget_gib} GiB is too small: even full recompute of every layer does not "
                        f"fit; the smallest that fits is {need:.2f} GiB per GPU ({precision}, {where})")
    modes = layer_modes(mix, model.layers, parallel.pp, parallel.virtual_stages)
    return modes, (mix.ops if ops else tuple(model.recompute_ops))


def planner_precision(train_precision: str, device: str | None = None) -> str:
    """The planner's precision (``bf16`` | ``fp32``) for ``train.precision``: bf16-autocast keeps bf16
    activations (its fp32 state is 16 bytes per parameter, counted as bf16's 20: on the safe side);
    ``auto`` is bf16 on CUDA, fp32 elsewhere (``device`` defaults to CUDA when one is visible)."""
    if train_precision == "auto":
        if device is None:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return "bf16" if str(device).startswith("cuda") else "fp32"
    return "fp32" if train_precision == "fp32" else "bf16"


def resolve_recompute(cfg: RunConfig, *, device: str | None = None) -> RunConfig:
    """``model.recompute: auto`` made concrete: a copy of ``cfg`` whose ``model.recompute_layers`` and
    ``model.recompute_ops`` are the planner's choice under ``train.memory_budget_gib``
    (:func:`auto_recompute`, the same search ``seqpar plan`` ranks: the fewest recomputed FLOPs that
    fit). Under auto ``model.recompute_ops`` lists the op-level choices auto may take (empty: none),
    and becomes the subset it takes. Any other mode returns ``cfg`` itself. Pure: no ``torch.distributed``; ``parallel.dp`` None counts as 1. ``UserError`` when no
    budget is set or even full recompute of every layer does not fit it."""
    if cfg.model.recompute != "auto":
        return cfg
    budget = cfg.train.memory_budget_gib
    if budget is None:
        raise UserError("model.recompute=auto needs train.memory_budget_gib (GiB per GPU the per-layer "
                        "recompute must fit)")
    precision = planner_precision(cfg.train.precision, device)
    try:
        modes, ops = auto_recompute(cfg.model, cfg.parallel, cfg.train, budget, precision,
                                    ops=allowed_ops(cfg.model, tuple(cfg.model.recompute_ops)))
    except UserError as err:
        raise UserError(f"model.recompute=auto, train.memory_budget_gib={budget}: {err}") from None
    return replace(cfg, model=replace(cfg.model, recompute_layers=tuple(modes), recompute_ops=ops))


def recompute_layers(config: str | Path, budget_gib: float, *, precision: str = "bf16",
                     global_batch: int | None = None) -> list[Mode]:
    """:func:`auto_recompute_layers` for a run config file or shipped name (``paper/22b``)."""
    _, sections = load_sections(config)
    try:
        return auto_recompute_layers(sections["model"], sections["parallel"], sections["train"], budget_gib,
                                     precision, global_batch)
    except UserError as err:
        raise UserError(f"{config}: {err}") from None


__all__ = ["OP_FLOPS_PER_ELEMENT", "allowed_ops", "auto_recompute", "auto_recompute_layers", "best_choice",
           "best_mix", "choice_flops", "op_flops", "layer_modes", "planner_precision", "recompute_flops",
           "recompute_layers", "resolve_recompute", "stage_layer_ids"]
