"""``seqpar train CONFIG --dry-run --world N [--rank R ...] [--gpu NAME] [--json]``: the dry run's
command: each rank built and stepped on fake tensors (:mod:`seqpar.tools.dryrun`), printed as a
table (or JSON) next to the planner's figures (:mod:`seqpar.tools.dryrun_check`). Exit status 2
with one line per problem when the run would fail on the cluster."""
from __future__ import annotations

import json
from collections.abc import Callable

from ..config import RunConfig
from ..errors import UserError
from ..memory.units import human
from ..plan.gpus import GPU, get_gpu
from .dryrun import RankRun, default_ranks, dry_run_rank
from .dryrun_check import Check, check_rank
from ..train.resolve import ResolvedRun, resolve_run


def _ratio(a: float | None, b: float) -> str:
    return f"{a / b:.3f}" if a is not None and b else ""


def _header(name: str, run: ResolvedRun, r: RankRun, check: Check) -> str:
    c = r.coords
    where = ", ".join(f"{k} {i}/{n}" for k, (i, n) in c.items() if n > 1 or k in ("pp", "tp"))
    stages = f"pipeline stage(s) {r.stages}, " if run.cfg.parallel.pp > 1 else ""
    return (f"## dry run of {name}: rank {r.rank} of {r.world} ({where}): {stages}{r.layers_built} of "
            f"{run.cfg.model.layers} layers built, {r.parameters:,} parameters, {r.micro_batches} micro-batch(es) "
            f"of {run.cfg.train.micro_batch} x {run.cfg.model.seq_len} tokens, {r.precision}"
            + (f", {run.dp_mode} over dp" + (" x cp" if run.cfg.parallel.cp > 1 else "") if run.dp > 1 else ""))


def _memory_table(check: Check, gpu: GPU | None) -> list[str]:
    lines = ["| bytes per GPU | measured | planner | ratio |", "|---|---:|---:|---:|"]
    lines += [f"| {k} | {human(m)} | {human(p)} | {_ratio(m, p)} |" for k, m, p in check.rows]
    fits = "" if gpu is None else (f" of {gpu.name}'s {human(gpu.hbm_bytes)}: "
                                   + ("fits" if check.peak <= gpu.hbm_bytes else "DOES NOT FIT"))
    lines.append(f"| **peak** (measured terms + planner's others){fits} | {human(check.peak)} | "
                 f"{human(check.planned_peak)} | {_ratio(check.peak, check.planned_peak)} |")
    return lines


def _comm_table(r: RankRun) -> list[str]:
    lines = ["| collective | group | calls | bytes | of them in layers |", "|---|---|---:|---:|---:|"]
    lines += [f"| {row['kind']} | {row['group']} | {row['calls']:,} | {human(row['bytes'])} | "
              + (f"{row['layer_calls']:,} calls, {human(row['layer_bytes'])} |" if row["layer_calls"] else "- |")
              for row in r.comm]
    return lines


def _calls(comm: dict[str, tuple[float, float]]) -> str:
    return " + ".join(f"{c:g} {kind}" for kind, (c, _) in sorted(comm.items())) or "none"


def _layer_table(check: Check) -> list[str]:
    """TP communication per layer and micro-batch: measured, seqpar's layers, the paper's."""
    lc, wire = check.layer_comm, check.layer_wire
    if not lc.get("seqpar"):
        return ["tp per layer: none (t = 1)"]
    rows = (("measured in the layers", "measured"), ("seqpar's layers (+ backward re-gathers)", "seqpar"),
            ("the paper, §4.2.2 (= 4 all-reduces)", "paper"))
    lines = ["| tp per layer and micro-batch | collectives | bytes | sent per rank (ring) | ratio |",
             "|---|---|---:|---:|---:|"]
    for label, key in rows:
        total = sum(n for _, n in lc[key].values())
        lines.append(f"| {label} | {_calls(lc[key])} | {human(total)} | {human(wire[key])} | "
                     f"{_ratio(wire[key], wire['seqpar'])} |")
    return lines


def _expert_table(run: ResolvedRun, check: Check) -> list[str]:
    """An MoE model's lines: all-to-alls over ep per MoE layer and micro-batch, measured and by
    formula (under ep), and how the dry run routed (:mod:`seqpar.tools.dryrun_routing`)."""
    ec, moe = check.expert_comm, run.cfg.model.moe
    if moe is None:
        return []
    lines = []
    if ec:
        rows = (("measured in the MoE layers", "measured"), ("formula (seqpar/memory/moe.py, even load)", "formula"))
        lines = ["", "| ep per MoE layer and micro-batch | all_to_all calls | bytes | ratio |", "|---|---:|---:|---:|"]
        lines += [f"| {label} | {ec[key][0]:g} | {human(ec[key][1])} | {_ratio(ec[key][1], ec['formula'][1])} |"
                  for label, key in rows]
    peers = ", and every ep peer routes alike" if run.cfg.parallel.ep > 1 else ""
    return [*lines, "", f"routing: balanced stand-in (fake tensors have no router values): each of the "
            f"{moe.experts} experts gets n k / E = 1/{moe.experts} of a rank's n x {moe.top_k} assignments{peers}; "
            f"a real router's uneven load is not seen"]


def rank_text(name: str, run: ResolvedRun, r: RankRun, check: Check, gpu: GPU | None) -> str:
    """The printed report of one rank."""
    lines = [_header(name, run, r, check), "", *_memory_table(check, gpu), "", *_comm_table(r), "",
             *_layer_table(check), *_expert_table(run, check), "",
             f"wall {r.seconds:.1f} s, peak RSS {human(r.peak_rss)}"]
    lines += [f"problem: {p}" for p in check.problems]
    return "\n".join(lines)


def rank_json(r: RankRun, check: Check) -> dict:
    """One rank's figures for ``--json``."""
    return {"rank": r.rank, "world": r.world, "coords": {k: list(v) for k, v in r.coords.items()},
            "stages": r.stages, "layers_built": r.layers_built, "layers_expected": check.layers_expected,
            "parameters": r.parameters, "micro_batches": r.micro_batches, "precision": r.precision,
            "memory": [{"part": k, "measured": m, "planner": p} for k, m, p in check.rows],
            "peak": check.peak, "planner_peak": check.planned_peak, "capacity": check.capacity,
            "collectives": r.comm, "layer_comm": {k: {kind: list(x) for kind, x in v.items()}
                                                  for k, v in check.layer_comm.items()},
            "layer_wire_bytes": check.layer_wire, "expert_comm": {k: list(v) for k, v in check.expert_comm.items()},
            "seconds": r.seconds, "peak_rss": r.peak_rss,
            "problems": check.problems}


def _gpu(gpu: str | GPU | None) -> GPU | None:
    return gpu if isinstance(gpu, GPU) or gpu is None else get_gpu(gpu)


def dry_run(cfg: RunConfig, world: int, ranks: list[int] | None = None, *, device: str = "cuda",
            gpu: str | GPU | None = None, tolerance: float | None = None) -> list[tuple[ResolvedRun, RankRun, Check]]:
    """Resolve ``cfg`` for ``world`` ranks and dry-run each of ``ranks`` (default: the first rank
    of the first and of the last pipeline stage); a problem in resolving names the ranks.
    ``tolerance``: a measured peak further than this from the planner's is a problem."""
    if world < 1:
        raise UserError(f"--world must be at least 1 (got {world})")
    table = _gpu(gpu)
    pc = cfg.parallel
    if ranks is None and world % (pc.pp * pc.tp * pc.cp) == 0:
        ranks = default_ranks(world, pc.pp)
    try:
        run = resolve_run(cfg, world, device)
    except UserError as err:
        who = f"rank {ranks[0]}" if ranks and len(ranks) == 1 else (
            f"ranks {', '.join(map(str, ranks))}" if ranks else "every rank")
        raise UserError(f"{who} of {world}: {err}") from err
    out = []
    for rank in ranks:
        r = dry_run_rank(run, rank, device)
        out.append((run, r, check_rank(run, r, table, device, tolerance)))
    return out


def report(name: str, results: list[tuple[ResolvedRun, RankRun, Check]], *, gpu: str | GPU | None = None,
           as_json: bool = False, print_: Callable[[str], None] = print) -> list[str]:
    """Print every rank's report (text or one JSON document); returns the problems found."""
    table = _gpu(gpu)
    problems = [p for *_, c in results for p in c.problems]
    if as_json:
        ranks = [rank_json(r, c) for _, r, c in results]
        print_(json.dumps({"config": name, "gpu": table.name if table else None, "ranks": ranks, "problems": problems},
                          indent=1))
    else:
        print_("\n\n".join(rank_text(name, run, r, c, table) for run, r, c in results))
    return problems


def main(name: str, cfg: RunConfig, *, world: int, ranks: list[int] | None, device: str, gpu: str | GPU | None,
         as_json: bool, tolerance: float | None = None) -> int:
    """``seqpar train --dry-run``: print the report; a problem is a :class:`UserError` (exit 2)."""
    results = dry_run(cfg, world, ranks, device=device, gpu=gpu, tolerance=tolerance)
    problems = report(name, results, gpu=gpu, as_json=as_json)
    if problems:
        raise UserError("; ".join(problems))
    return 0


__all__ = ["dry_run", "main", "rank_json", "rank_text", "report"]
