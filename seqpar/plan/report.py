"""What ``seqpar plan`` prints: the ranked table, one layout's breakdown, the ``seqpar train`` overrides."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from ..config import TrainConfig, load_run_config
from ..errors import UserError
from ..model.config import GPTConfig
from .gpus import GIB
from .layout import Layout
from .memory import STATE_PARTS
from .recompute import layer_modes, resolve_recompute
from .search import Candidate

ACTIVATION_PARTS = ("activations", "outside_layers")


def memory_columns(c: Candidate) -> tuple[float, float, float, float]:
    """(total, state, activations, other) GiB per GPU: other is the backward transient and the allowance."""
    parts = c.memory.parts
    state = sum(parts.get(k, 0.0) for k in STATE_PARTS)
    acts = sum(parts.get(k, 0.0) for k in ACTIVATION_PARTS)
    total = c.memory.total
    return total / GIB, state / GIB, acts / GIB, (total - state - acts) / GIB


def table(ranked: Sequence[Candidate]) -> str:
    """Markdown table of candidates: layout, GiB per GPU with its parts, step seconds, MFU, HFU."""
    lines = ["| # | layout | GiB/GPU | state | activations | other | step (s) | MFU | HFU |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(ranked, 1):
        total, state, acts, other = memory_columns(c)
        lines.append(f"| {i} | {c.layout.label()} | {total:.1f} | {state:.1f} | {acts:.1f} | {other:.1f} "
                     f"| {c.time.seconds:.2f} | {100 * c.time.mfu:.1f}% | {100 * c.time.hfu:.1f}% |")
    return "\n".join(lines)


def breakdown(c: Candidate) -> str:
    """One layout: predicted step time by part and memory per GPU by part."""
    lines = [f"layout: {c.layout.label()}", f"predicted step time: {c.time.seconds:.2f} s "
             f"(MFU {100 * c.time.mfu:.1f}%, HFU {100 * c.time.hfu:.1f}%)"]
    lines += [f"  {k:<22} {v:9.3f} s" for k, v in c.time.parts.items()]
    lines.append(f"memory per GPU: {c.memory.total / GIB:.2f} GiB of {c.memory.capacity / GIB:.2f} GiB "
                 f"(stage {c.memory.stage})")
    lines += [f"  {k:<22} {v / GIB:9.2f} GiB" for k, v in c.memory.parts.items()]
    lines.append("fits" if c.memory.fits else f"does not fit: {c.memory.overflow()}")
    return "\n".join(lines)


def runs(modes: Sequence[str]) -> str:
    """Run-length form of a per-layer list: ``[selective]*64 + [none]*32``."""
    out: list[list] = []
    for m in modes:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return " + ".join(f"[{m}]*{k}" for m, k in out)


def _has_field(cls: type, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(cls)}


def _schedule(layout: Layout) -> str:
    return "Interleaved1F1B" if layout.virtual_stages > 1 else "1F1B"


def overrides(layout: Layout, model: GPTConfig, global_batch: int, precision: str,
              budget_gib: float | None = None) -> tuple[list[str], list[str]]:
    """(``key=value`` overrides for ``seqpar train``, notes). A per-layer mix is written as
    ``model.recompute=auto train.memory_budget_gib=budget_gib`` (the Trainer resolves it with the same
    search, :func:`seqpar.plan.recompute.resolve_recompute`), with the explicit
    ``model.recompute_layers`` list in a note; without a budget, as that list."""
    rc = layout.recompute
    out = [f"parallel.tp={layout.tp}", f"parallel.pp={layout.pp}", f"parallel.virtual_stages={layout.virtual_stages}",
           f"parallel.dp={layout.dp}", f"parallel.data_parallel={layout.data_parallel}",
           f"train.micro_batch={layout.micro_batch}", f"train.global_batch={global_batch}",
           f"model.sequence_parallel={'true' if layout.sequence_parallel else 'false'}"]
    if layout.pp > 1:
        out.insert(3, f"parallel.pp_schedule={_schedule(layout)}")
    if layout.cp > 1:  # the ring (its K/V steps overlap the attention); the all-gather with pipeline stages
        out[4:4] = [f"parallel.cp={layout.cp}", f"parallel.cp_comm={layout.cp_comm}"]
    if model.moe is not None:  # experts over ep of the dp x cp ranks (1: the config's ep is overridden too)
        out.insert(out.index(f"parallel.data_parallel={layout.data_parallel}"), f"parallel.ep={layout.ep}")
    notes = []
    if rc.kind == "mixed":
        modes = layer_modes(rc, model.layers, layout.pp, layout.virtual_stages)
        listed = "model.recompute_layers=[" + ",".join(modes) + "]"
        if budget_gib is None:
            out.append(listed)
        else:
            out += ["model.recompute=auto", f"train.memory_budget_gib={budget_gib:.10g}"]
            notes.append(f"model.recompute=auto resolves to {rc.label()} on every stage, {runs(modes)}; "
                         f"to pin it instead: {listed}")
    else:
        out.append(f"model.recompute={rc.kind}")
        if rc.kind == "full":
            out += [f"model.recompute_method={rc.method}", f"model.recompute_num_layers={rc.num_layers}"]
        if getattr(model, "recompute_layers", None) is not None:
            out.append("model.recompute_layers=null")  # the config's own list would override recompute
    if rc.ops:  # the op-level choices (under auto: the ones it may take, which it takes again)
        out.append("model.recompute_ops=[" + ",".join(rc.ops) + "]")
    if _has_field(TrainConfig, "precision"):
        out.append(f"train.precision={precision}")
    return out, notes


def check_overrides(config: str | Path, items: list[str]) -> str | None:
    """The error ``seqpar train`` would raise for these overrides today, or None (``recompute: auto``
    resolved as the Trainer does)."""
    try:
        cfg = load_run_config(config, items)
        cfg.validate()
        resolve_recompute(cfg)
    except UserError as err:
        return str(err)
    return None


def plot(ranked: Sequence[Candidate], path: str | Path, title: str) -> None:
    """Two panels for the given layouts: memory per GPU by part (stacked) and predicted step time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5 + 0.25 * len(ranked)))
    FigureCanvasAgg(fig)
    mem_ax, time_ax = fig.subplots(1, 2, sharey=True)
    labels = [f"{i}. {c.layout.label()}" for i, c in enumerate(ranked, 1)][::-1]
    cols = [memory_columns(c) for c in ranked][::-1]
    left = [0.0] * len(cols)
    for j, name in enumerate(("state", "activations", "other"), start=1):
        widths = [c[j] for c in cols]
        mem_ax.barh(labels, widths, left=left, label=name)
        left = [a + w for a, w in zip(left, widths)]
    mem_ax.axvline(ranked[0].memory.capacity / GIB, color="k", linestyle="--", linewidth=1, label="capacity")
    mem_ax.set_xlabel("GiB per GPU")
    mem_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=4, fontsize=8)
    seconds = [c.time.seconds for c in ranked][::-1]
    bars = time_ax.barh(labels, seconds, color="tab:gray")
    time_ax.bar_label(bars, labels=[f"{x:.2f} s" for x in seconds], fontsize=8)
    time_ax.margins(x=0.15)
    time_ax.set_xlabel("predicted step time (s)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
