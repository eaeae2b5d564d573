"""``seqpar memory``: activation memory per technique, from the paper's formulas and measured.

For each model it prints a Markdown table with Table 2's bytes per layer, the per-GPU total of
Figure 1 (per layer x L x the interleaving factor of the first pipeline stage) and the share of
the TP baseline (Figure 7). ``--measure`` builds the model on ``t`` gloo ranks on this machine and
adds the bytes :class:`~seqpar.memory.ledger.ActivationLedger` sees each layer keep for backward;
``--png`` draws Figure 7 as a grouped bar chart.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from typing import Sequence

from ..distributed.context import check_context_layout
from ..errors import UserError
from ..memory.formulas import (PAPER_MODELS, ModelShape, bytes_per_layer, extra_bytes, gib, interleave_factor,
                               load_sections, paper_config_dir, per_gpu_bytes, ratio_to_tp, shape_of)
from ..memory.state import state_table
from ..memory.units import human, unit_for
from ..model.config import GPTConfig
from ..model.modes import DATA_PARALLEL_MODES, PRECISIONS
from ..memory.whole_model import attention_kernel
from .context_memory import cp_table
from .memory_measure import (RANK_TIMEOUT_S, ROWS, RUN_TIMEOUT_S, first_stage_table, measure, measure_first_stage,
                             measured_formula, row_config)


@dataclasses.dataclass
class Entry:
    """One model of the report: its shape for the formulas and its ``model:`` section."""

    shape: ModelShape
    model: GPTConfig  # the file's model section, checked by the strict loader
    path: Path


OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)*=")  # model.seq_len=131072, not a path


def load_entry(path: str | Path, micro_batch: int | None = None, tp: int | None = None,
               overrides: Sequence[str] = ()) -> Entry:
    """Read a config file or shipped config name (``model``, ``parallel``, ``train`` sections, checked
    strictly; others ignored), with ``key=value`` ``overrides`` and the flags' values. Errors name the path."""
    path, sections = load_sections(path, overrides)
    shape = shape_of(path.stem.upper(), sections)
    if micro_batch is not None:
        shape = dataclasses.replace(shape, b=micro_batch)
    if tp is not None:
        shape = dataclasses.replace(shape, t=tp)
    return Entry(shape, sections["model"], path)


def estimate_bytes(e: Entry) -> int:
    """Rough host bytes to measure ``e`` here: t ranks x (TP-baseline activations + bf16 weights).

    Weights count in full on every rank: each rank builds the master tensor before slicing it.
    """
    s, b, h, a, L, v, t = (getattr(e.shape, k) for k in ("s", "b", "h", "a", "L", "v", "t"))
    ffn = e.model.ffn_hidden
    params = L * (4 * h * h + 2 * h * ffn) + (v + s) * h
    acts = bytes_per_layer("tp", s=s, b=b, h=h, a=a, t=t) * L + sum(extra_bytes(s=s, b=b, h=h, v=v, t=t, p=1).values())
    return int(t * (acts + 2 * params))


def table(shape: ModelShape, measured: dict[str, int] | None = None, expected: dict[str, int] | None = None,
          kernel: str = "math") -> str:
    """A Markdown table for one model: formula bytes per technique, and measured ones if given,
    against ``expected`` (the formula for the attention ``kernel`` they ran; default Table 2's)."""
    dims = dict(s=shape.s, b=shape.b, h=shape.h, a=shape.a, t=shape.t)
    factor = interleave_factor(shape.p, shape.m)
    lines = [f"### {shape.name}: s={shape.s} b={shape.b} h={shape.h} a={shape.a} L={shape.L} t={shape.t} "
             f"p={shape.p} m={shape.m} (per GPU = per layer x {shape.L} layers x interleave {factor:.4g})", ""]
    head = ["technique", "per layer (Table 2)", "per GPU", "% of TP"]
    other_kernel = measured is not None and expected is not None and kernel != "math"
    if other_kernel:
        head += [f"formula, {kernel} attention (bytes)"]
    if measured is not None:
        head += ["measured per layer (bytes)", "measured / formula"]
    lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    # one unit per column, chosen so that the smallest entry still reads as >= 0.1
    unit = unit_for(min(bytes_per_layer(tech, **dims) for tech in ROWS), 0.1)
    gpu_unit = unit_for(min(per_gpu_bytes(shape, tech) for tech in ROWS), 0.1)
    for tech, (label, _, _) in ROWS.items():
        formula = bytes_per_layer(tech, **dims)
        row = [label, human(formula, unit), human(per_gpu_bytes(shape, tech), gpu_unit),
               f"{100 * ratio_to_tp(tech, **dims):.2f}%"]
        if other_kernel:
            formula = expected[tech]
            row += [f"{formula:,}"]
        if measured is not None:
            row += [f"{measured[tech]:,}", f"{measured[tech] / formula:.4f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def recompute_ops_line(shape: ModelShape, ops: tuple[str, ...]) -> str:
    """Table 2's last row with the config's ``model.recompute_ops`` rebuilt in backward too
    (docs/memory.md, "Op-level recompute choices")."""
    dims = shape.layer_dims
    plain, with_ops = (bytes_per_layer("tp_sp_selective", **dims, recompute_ops=o) for o in ((), ops))
    per_gpu = with_ops * shape.L * interleave_factor(shape.p, shape.m)
    coefficient = with_ops * shape.t / (shape.s * shape.b * shape.h)  # 16-bit activations: bytes / (sbh/t)
    return (f"with model.recompute_ops [{', '.join(ops)}]: TP + SP + selective keeps {human(with_ops)} per layer "
            f"({float(coefficient):.4g} sbh/t, {float(with_ops / plain):.1%} of the row above), {human(per_gpu)} per GPU")


def plot(shapes: Sequence[ModelShape], path: str | Path) -> None:
    """Figure 7: per model, one bar per technique as a percentage of the TP baseline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    techs = [k for k in ROWS if k != "tp"]
    fig = Figure(figsize=(9, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    width = 0.8 / len(techs)
    for i, tech in enumerate(techs):
        xs = [j + (i - (len(techs) - 1) / 2) * width for j in range(len(shapes))]
        ys = [100 * ratio_to_tp(tech, s=sh.s, b=sh.b, h=sh.h, a=sh.a, t=sh.t) for sh in shapes]
        bars = ax.bar(xs, ys, width, label=ROWS[tech][0])
        ax.bar_label(bars, labels=[f"{y:.1f}" for y in ys], fontsize=7, padding=1)
    ax.axhline(100, color="black", linestyle="--", linewidth=1, label="TP baseline")
    ax.set_xticks(range(len(shapes)), [sh.name for sh in shapes])
    ax.set_ylim(0, 115)
    ax.set_ylabel("activation memory, % of TP baseline")
    ax.set_title("Activation memory per GPU relative to tensor parallelism (Table 2 formulas)")
    ax.legend(ncol=5, fontsize=8, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def _check_layouts(entries: list[Entry], cp: int | None = None) -> list[Entry]:
    """``entries``, each model's dimensions checked against its t (``--tp`` or ``parallel.tp``), its
    layers against pp x virtual_stages and its sequence against ``--cp``: a layout that cannot run
    is refused (:class:`UserError` naming the values) before any figure is printed."""
    for e in entries:
        try:
            e.model.check_parallel(e.shape.t)
            if cp is not None:
                try:
                    check_context_layout(e.model.seq_len, cp, e.shape.t, e.model.sequence_parallel)
                except UserError as ex:
                    raise UserError(f"--cp {cp}: {ex}") from None
        except UserError as ex:
            raise UserError(f"{e.path}: {ex}") from None
        if e.shape.p > 1 and e.model.layers % (e.shape.p * e.shape.m):
            raise UserError(f"{e.path}: model.layers={e.model.layers} is not divisible into pp x virtual_stages = "
                            f"{e.shape.p} x {e.shape.m} pipeline stages")
    return entries


def _check_measurable(entries: Sequence[Entry]) -> None:
    """Check each model's dimensions against its t before any rank is spawned (measured with
    sequence parallelism, so the sequence must split over t too)."""
    for e in entries:
        cfg = e.model
        try:
            dataclasses.replace(cfg, sequence_parallel=True).check_parallel(e.shape.t)
        except UserError as ex:
            raise UserError(f"{e.path}: {ex}") from None
        if cfg.ffn_hidden != 4 * cfg.hidden:
            print(f"seqpar memory: note: {e.path}: ffn_hidden={cfg.ffn_hidden} != 4h; Table 2 assumes 4h",
                  file=sys.stderr)


def _print_first_stage(e: Entry) -> bool:
    """Measure and print the first pipeline stage's peak (pp > 1); False (reported) when a rank failed."""
    print(f"measuring {e.shape.name}'s first pipeline stage on {e.shape.p * e.shape.t} gloo ranks ...",
          file=sys.stderr, flush=True)
    try:
        stage = measure_first_stage(e.model, e.shape, RUN_TIMEOUT_S, RANK_TIMEOUT_S)
    except Exception as ex:  # a rank failed: its traceback is in the message
        err(f"measuring {e.path}'s pipeline failed: {ex}")
        return False
    print(first_stage_table(e.shape, stage) + "\n", flush=True)
    return True


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar memory", description=(
        "Activation memory per technique: Table 2 bytes per layer, per GPU (Figure 1) and relative to "
        "the TP baseline (Figure 7); --measure adds the bytes a small model keeps on t gloo ranks."))
    p.add_argument("configs", nargs="*", help="model YAML files (model/parallel/train sections) or shipped "
                   "config names (memory-demo, paper/175b), and key=value overrides for all of them as seqpar "
                   "train takes them (model.seq_len=131072)")
    p.add_argument("--paper", action="store_true", help="the four models of Table 3 (the default with no configs)")
    p.add_argument("--measure", action="store_true", help="also measure saved bytes on t gloo ranks (small models); "
                   "with pp > 1 also the first pipeline stage's peak during one step, on pp x t ranks")
    p.add_argument("--png", type=Path, metavar="PATH", help="write a Figure 7 style bar chart")
    p.add_argument("--micro-batch", type=int, metavar="B", help="override train.micro_batch")
    p.add_argument("--tp", type=int, metavar="T", help="override parallel.tp")
    p.add_argument("--cp", type=int, metavar="N", help="also print per-rank activation bytes with context "
                   "parallelism over N ranks (each holding s/N of every sequence), per recompute mode")
    p.add_argument("--dp", type=int, metavar="DP", help="also print the training state per rank at this "
                   "data-parallel size (parameters, gradients, AdamW)")
    p.add_argument("--data-parallel", choices=DATA_PARALLEL_MODES, help="with the state table: only this mode "
                   "(default: both)")
    p.add_argument("--precision", choices=PRECISIONS, help="with the state table: "
                   "train.precision (default: bf16)")
    p.add_argument("--max-gib", type=float, default=2.0, metavar="GIB",
                   help="refuse --measure above this estimate of activations+weights (default 2)")
    return p


def split_overrides(items: Sequence[str]) -> tuple[list[Path], list[str]]:
    """(config paths, ``key=value`` overrides) of the positional arguments."""
    overrides = [x for x in items if OVERRIDE.match(x)]
    return [Path(x) for x in items if not OVERRIDE.match(x)], overrides


def _parse(argv: list[str]) -> argparse.Namespace:
    """The parsed command line, its positional arguments split into ``configs`` and ``overrides``."""
    args = _parser().parse_intermixed_args(argv)
    args.configs, args.overrides = split_overrides(args.configs)
    return args


def err(msg: str) -> None:
    """Report a failed measurement (exit 1; bad input raises :class:`UserError` instead)."""
    print(f"seqpar memory: error: {msg}", file=sys.stderr)


def _check_args(args: argparse.Namespace) -> None:
    """The flags' values: :class:`UserError` naming the first bad one."""
    for name in ("micro_batch", "tp", "dp", "cp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--png needs matplotlib: pip install matplotlib (or pip install 'seqpar[plot]')")


def main(argv: list[str]) -> int:
    """Entry point of ``seqpar memory``; returns the exit status (1: a measurement failed). Bad input
    (a flag, a config, a layout the model cannot split, a model too big to measure here) raises
    :class:`UserError` before anything is printed: the ``seqpar`` command prints it as one line
    and exits 2."""
    args = _parse(argv)
    _check_args(args)
    paths = list(args.configs)
    if args.paper or not paths:
        paths = [paper_config_dir() / f"{n}.yaml" for n in PAPER_MODELS] + paths
    entries = _check_layouts([load_entry(p, args.micro_batch, args.tp, args.overrides) for p in paths], args.cp)
    if args.measure:
        too_big = [f"{e.shape.name} (~{gib(estimate_bytes(e)):.1f} GiB over {e.shape.t} ranks)"
                   for e in entries if gib(estimate_bytes(e)) > args.max_gib]
        if too_big:
            raise UserError(f"--measure refused: {', '.join(too_big)} above the {args.max_gib:g} GiB limit of "
                            f"activations and weights for this machine (--max-gib); measure a small config such "
                            f"as configs/memory-demo.yaml")
        _check_measurable(entries)
    print("Activation memory per technique (Korthikanti et al. 2022, Table 2): 16-bit activations, 1-byte "
          "dropout masks; per GPU = first pipeline stage, terms outside the layers left out.\n", flush=True)
    for e in entries:
        measured = None
        if args.measure:
            kernel = attention_kernel(row_config(e.model, "tp"), "cpu")
            print(f"measuring {e.shape.name} on {e.shape.t} gloo rank(s): bf16, {e.model.attention} attention "
                  f"({kernel} kernel on CPU), dropout 0.1 "
                  f"(~{gib(estimate_bytes(e)):.2f} GiB) ...", file=sys.stderr, flush=True)
            try:
                measured = measure(e.model, e.shape)
            except Exception as ex:  # a rank failed: its traceback is in the message
                err(f"measuring {e.path} failed: {ex}")
                return 1
        kernel = attention_kernel(row_config(e.model, "tp"), "cpu")
        expected = measured_formula(e.model, e.shape) if measured is not None else None
        print(table(e.shape, measured, expected, kernel) + "\n", flush=True)
        if e.model.recompute_ops:
            print(recompute_ops_line(e.shape, tuple(e.model.recompute_ops)) + "\n", flush=True)
        if args.measure and e.shape.p > 1 and not _print_first_stage(e):
            return 1
        if args.cp is not None:
            print(cp_table(e.model, t=e.shape.t, micro_batch=e.shape.b, cp=args.cp, name=e.shape.name) + "\n",
                  flush=True)
        if args.dp is not None or args.data_parallel or args.precision:
            modes = [args.data_parallel] if args.data_parallel else list(DATA_PARALLEL_MODES)
            layouts = [(args.dp or 1, mode) for mode in modes]
            print(state_table(e.model, t=e.shape.t, layouts=layouts, precision=args.precision or "bf16") + "\n",
                  flush=True)
    if args.png is not None:
        plot([e.shape for e in entries], args.png)
        print(f"wrote {args.png}")
    return 0

