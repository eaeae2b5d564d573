"""``seqpar plan CONFIG [key=value ...] --gpus N --gpu NAME``: which layout fits and is fastest, predicted.

Searches the layouts of the config's model (with ``key=value`` overrides as ``seqpar train`` takes
them, e.g. ``model.seq_len=131072``) on N GPUs (see :mod:`seqpar.plan.search`), prints the
fastest ``--top`` as a Markdown table and the exact ``seqpar train`` overrides of the best, or,
with ``--layout``, the predicted step time and memory of one layout (exit status 1 if it does
not fit). ``--gpu custom`` takes the figures from ``--peak-tflops``, ``--hbm-gib``,
``--nvlink-gbps`` and ``--ib-gbps`` (gigabytes per second per GPU, one direction).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import UserError
from ..memory.formulas import load_sections
from ..model.modes import RECOMPUTE_MODES
from ..model.recompute_ops import check_recompute_ops
from .gpus import GIB, GPU, GPUS, custom_gpu, get_gpu
from .layout import Layout, Recompute, parse_layout
from .memory import HEADROOM
from .recompute import auto_recompute_layers, best_mix, stage_layer_ids
from .report import breakdown, check_overrides, overrides, plot, table
from .search import PAPER_SPACE, Candidate, Problem, SearchSpace, evaluate, search

@dataclass(frozen=True)
class Planned:
    """What a ``seqpar plan`` command chose: its exit status, the GPU, and the ``seqpar train``
    overrides of the chosen layout (the best, or ``--layout``'s), which ``--verify`` dry-runs
    (:mod:`seqpar.tools.plan_cli`)."""

    status: int
    gpu: GPU
    overrides: list[str]


def parser() -> argparse.ArgumentParser:
    """``seqpar plan``'s arguments (:mod:`seqpar.tools.plan_cli` adds ``--verify``)."""
    p = argparse.ArgumentParser(prog="seqpar plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="run config: a YAML file or a shipped name (paper/175b)")
    p.add_argument("overrides", nargs="*", help="key=value overrides as seqpar train takes them, "
                                                "e.g. model.seq_len=131072")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpu", required=True, help=f"one of {sorted(GPUS) + ['custom']}")
    p.add_argument("--global-batch", type=int, help="sequences per step (default: the config's train.global_batch)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing NVLink (default 8)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--layout", help="evaluate one layout, e.g. tp=8,pp=8,virtual_stages=3,micro_batch=1,"
                                    "sequence_parallel=true,recompute=selective")
    p.add_argument("--png", type=Path, help="plot memory per GPU and step time of the top layouts")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16", help="training precision (default bf16)")
    p.add_argument("--headroom", type=float, default=HEADROOM, metavar="FRACTION",
                   help=f"fraction of each GPU's memory a layout must leave free beyond the allowance "
                        f"(default {HEADROOM:g})")
    p.add_argument("--space", choices=("all", "paper"), default="all",
                   help="paper: the paper's choices only (t=8, uniform recompute, no FSDP)")
    p.add_argument("--mixes", action="store_true", help="also rank per-layer recompute mixes")
    p.add_argument("--recompute-ops", metavar="OPS", default="",
                   help="comma-separated model.recompute_ops choices (norm, activation, dropout) the per-layer "
                        "mixes may add to their none / selective layers; implies --mixes")
    for flag, help_ in (("--peak-tflops", "custom: dense bf16 TFLOP/s"), ("--hbm-gib", "custom: memory, GiB"),
                        ("--nvlink-gbps", "custom: intra-node GB/s per direction"),
                        ("--ib-gbps", "custom: inter-node GB/s per direction"),
                        ("--hbm-tbps", "custom: memory bandwidth, TB/s (default 2.039)")):
        p.add_argument(flag, type=float, help=help_)
    p.add_argument("--sms", type=int, help="custom: streaming multiprocessors (default 108)")
    return p


def _gpu(args: argparse.Namespace):
    extra = {"peak_tflops": args.peak_tflops, "hbm_gib": args.hbm_gib, "nvlink_gbps": args.nvlink_gbps,
             "ib_gbps": args.ib_gbps}
    if args.gpu.lower() != "custom":
        given = [k for k, v in extra.items() if v is not None]
        if given:
            raise UserError(f"--{given[0].replace('_', '-')} applies to --gpu custom only, not --gpu {args.gpu}")
        return get_gpu(args.gpu)
    missing = [f"--{k.replace('_', '-')}" for k, v in extra.items() if v is None]
    if missing:
        raise UserError(f"--gpu custom needs {', '.join(missing)}")
    optional = {k: v for k, v in (("hbm_tbps", args.hbm_tbps), ("sms", args.sms)) if v is not None}
    return custom_gpu(**extra, **optional)


def _config_recompute(sections: dict, layout: Layout, budget_gib: float, precision: str, batch: int) -> Recompute:
    """The config's recompute as the planner counts it: uniform, or per-layer (``model.recompute_layers``,
    or ``auto`` resolved under ``train.memory_budget_gib``, else ``budget_gib``) counted on the first stage."""
    model, par, train = sections["model"], sections["parallel"], sections["train"]
    modes = model.recompute_layers
    if modes is None and model.recompute == "auto":
        modes = auto_recompute_layers(model, par, train, train.memory_budget_gib or budget_gib, precision, batch)
    if modes is None:
        return Recompute(model.recompute, model.recompute_method, model.recompute_num_layers)
    mine = [modes[i] for i in stage_layer_ids(model.layers, layout.pp, layout.virtual_stages, 0)]
    return Recompute("mixed", counts=tuple((m, mine.count(m)) for m in RECOMPUTE_MODES))


def _config_layout(sections: dict, problem: Problem) -> Layout:
    """The layout the config itself describes (dp defaults to the GPUs left over)."""
    model, par, train = sections["model"], sections["parallel"], sections["train"]
    dp = par.dp or max(1, problem.gpus // (par.tp * par.pp))
    mode = par.data_parallel_mode(dp) if hasattr(par, "data_parallel_mode") else "ddp"
    layout = Layout(par.tp, par.pp, dp, par.virtual_stages, train.micro_batch,
                    model.sequence_parallel and par.tp > 1, data_parallel=mode, ep=getattr(par, "ep", 1))
    budget = problem.budget / GIB
    return replace(layout, recompute=_config_recompute(sections, layout, budget, problem.precision,
                                                       problem.global_batch))


def _mix_note(problem: Problem, best: Candidate) -> str | None:
    """A note on the per-layer mix with the fewest recomputed FLOPs for the best layout, if it helps."""
    if best.layout.recompute.kind in ("none", "mixed"):
        return None
    mix = best_mix(problem.model, best.layout, problem.budget, problem.global_batch, problem.precision)
    if mix is None or sum(1 for _, k in mix.counts if k) < 2:
        return None
    c = evaluate(problem, replace(best.layout, recompute=mix))
    return (f"per-layer recompute {mix.label()} on every stage fits too ({c.memory.total / GIB:.1f} GiB) and is "
            f"predicted at {c.time.seconds:.2f} s ({c.time.seconds / best.time.seconds - 1:+.1%}); --mixes ranks mixes, "
            f"model.recompute=auto train.memory_budget_gib={problem.budget / GIB:.10g} trains one")


def _print_search(args, problem: Problem, sections: dict, name: str) -> list[str]:
    """Print the search; returns the ``seqpar train`` overrides of the best layout."""
    space = PAPER_SPACE if args.space == "paper" else SearchSpace()
    try:
        ops = check_recompute_ops(tuple(o.strip() for o in args.recompute_ops.split(",") if o.strip()),
                                  "--recompute-ops")
    except ValueError as e:
        raise UserError(str(e)) from None
    if args.mixes or ops:
        space = replace(space, recompute=(*space.recompute, "mixed"), recompute_ops=ops)
    start = time.perf_counter()
    result = search(problem, space, k=args.top)
    print(f"## {name} on {problem.gpus} x {problem.gpu.name}: global batch {problem.global_batch}, "
          f"{problem.gpus_per_node} GPUs per node, {problem.precision}, {problem.gpu.hbm_bytes / GIB:.1f} GiB per GPU"
          + (f" ({problem.headroom:.0%} kept free: {problem.budget / GIB:.1f} GiB planned)"
             if problem.headroom else ""))
    print(f"{result.evaluated} layouts evaluated, {len(result.ranked)} fit ({time.perf_counter() - start:.1f} s)\n")
    if not result.ranked:
        raise UserError(f"no layout of {name} fits {problem.gpus} x {problem.gpu.name}; try more GPUs or "
                        f"--layout to see which term overflows")
    top = result.ranked[:args.top]
    print(table(top) + "\n")
    try:
        own = _config_layout(sections, problem)
    except UserError as err:  # recompute: auto that fits no budget, a layout of other GPUs
        own = None
        print(f"the config's own layout does not plan here: {err}\n")
    rank = next((i for i, c in enumerate(result.ranked, 1) if c.layout == own), None)
    if rank is not None:
        print(f"the config's own layout ({own.label()}) ranks #{rank}: {result.ranked[rank - 1].time.seconds:.2f} s\n")
    best = top[0]
    items, notes = overrides(best.layout, problem.model, problem.global_batch, problem.precision,
                             problem.budget / GIB)
    print(f"best: {best.layout.label()}, predicted {best.time.seconds:.2f} s per step")
    items = [*args.overrides, *items]
    print(f"seqpar train {args.config} " + " ".join(items))
    refused = check_overrides(args.config, items)
    notes += [n for n in (_mix_note(problem, best),) if n]
    if refused:
        notes.append(f"seqpar train refuses these overrides today: {refused}")
    for note in notes:
        print(f"note: {note}")
    if args.png is not None:
        plot(top, args.png, f"{name} on {problem.gpus} x {problem.gpu.name}")
        print(f"wrote {args.png}")
    return items


def run(args: argparse.Namespace) -> Planned:
    """Carry out a parsed ``seqpar plan`` command; :class:`~seqpar.errors.UserError` for bad
    values."""
    bad = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("gpus", "gpus_per_node", "top", "global_batch")
           if getattr(args, k) is not None and getattr(args, k) < 1]
    if bad:
        raise UserError(f"need positive integers, got {', '.join(bad)}")
    if args.png is not None and importlib.util.find_spec("matplotlib") is None:
        raise UserError("--png needs matplotlib: pip install matplotlib (or pip install 'seqpar[plot]')")
    gpu = _gpu(args)
    path, sections = load_sections(args.config, args.overrides)
    batch = args.global_batch or sections["train"].global_batch
    if batch is None:
        raise UserError(f"{args.config} sets no train.global_batch; pass --global-batch")
    problem = Problem(sections["model"], args.gpus, gpu, batch, args.gpus_per_node, args.precision, args.headroom)
    name = path.stem.upper()
    if args.layout is None:
        return Planned(0, gpu, _print_search(args, problem, sections, name))
    c = evaluate(problem, parse_layout(args.layout, args.gpus))
    print(breakdown(c))
    items = overrides(c.layout, problem.model, batch, problem.precision, gpu.hbm_bytes / GIB)[0]
    return Planned(0 if c.memory.fits else 1, gpu, items)


def main(argv: list[str] | None = None) -> int:
    """``seqpar plan``: bad input raises :class:`~seqpar.errors.UserError`, which the ``seqpar``
    command prints as one line (exit 2)."""
    return run(parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)).status


if __name__ == "__main__":
    sys.exit(main())
