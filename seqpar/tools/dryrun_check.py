"""A dry-run rank's figures next to the planner's, and what would fail on the cluster.

The predictions are the planner's own (:func:`seqpar.plan.memory.stage_memory` for the rank's
pipeline stage: training state, saved activations in and outside the layers, the transients and
the allowance) and §4.2.2's per-layer communication (:mod:`seqpar.memory.comm`). The peak a GPU
would see is the planner's breakdown with every measured term put in place of its formula
(state, saved activations); what no tensor shows (the backward transient, the CUDA context,
NCCL buffers, workspaces, fragmentation) stays the planner's allowance.

Failures, each one line naming the rank and the values: a rank that built more transformer layers
than its stages hold (the whole model on a pipeline rank); a collective the layout needs that the
step never issued; a predicted peak above the memory of ``--gpu``; with a ``tolerance`` (``seqpar
plan --verify``), a peak further than that from the planner's, naming the term furthest off.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..memory.comm import WIRE_FACTOR, layer_wire_bytes
from ..memory.units import human
from ..plan.gpus import GIB, GPU
from ..plan.layout import run_layout
from ..plan.memory import allowance, stage_memory
from ..plan.recompute import stage_layer_ids
from .dryrun import RankRun
from .dryrun_experts import expert_comm, expert_needs, is_moe, paper_comm, seqpar_layer_comm
from ..train.resolve import ResolvedRun

MEASURED = ("parameters", "gradients", "optimizer", "activations", "outside_layers")  # planner parts measured here
# ``seqpar plan --verify``: how far the measured peak may lie from the planner's (the activation
# ledger agrees with the formulas within 3%, docs/planning.md); a plain dry run checks no ratio
VERIFY_TOLERANCE = 0.03


@dataclass
class Check:
    """One rank's comparison: ``rows`` of ``(part, measured, planned)`` bytes, the per-layer TP
    communication (measured, seqpar's layers, the paper's; calls and bytes per layer and
    micro-batch), the peaks and the problems found."""

    rows: list[tuple[str, float | None, float]]
    peak: float                 # bytes: planner breakdown with the measured terms
    planned_peak: float         # bytes: the planner's breakdown alone
    capacity: float | None      # bytes of --gpu's memory, None without --gpu
    layer_comm: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    layer_wire: dict[str, float] = field(default_factory=dict)  # bytes on the wire per layer and micro-batch
    expert_comm: dict[str, tuple[float, float]] = field(default_factory=dict)  # ep all-to-alls per MoE layer
    layers_expected: int = 0
    tolerance: float | None = None  # the largest |peak / planned_peak - 1| allowed (None: not checked)
    problems: list[str] = field(default_factory=list)


def _planner_precision(name: str) -> str:
    return "fp32" if name == "fp32" else "bf16"  # bf16-autocast: not modelled (fp32 state, ~bf16 activations)


def _stage_plan(run: ResolvedRun, r: RankRun, gpu: GPU | None, device: str):
    cfg, pc, tc = run.cfg, run.cfg.parallel, run.cfg.train
    stage = r.coords["pp"][0]
    layers = stage_layer_ids(cfg.model.layers, pc.pp, pc.virtual_stages, stage)
    layout = run_layout(cfg.model, tp=pc.tp, pp=pc.pp, dp=run.dp, virtual_stages=pc.virtual_stages,
                        micro_batch=tc.micro_batch, data_parallel=run.dp_mode, cp=pc.cp, stage_layers=layers,
                        ep=pc.ep)
    capacity = gpu.hbm_bytes if gpu is not None else math.inf
    memory = stage_memory(cfg.model, layout, capacity, tc.micro_batch * run.accum * run.dp, stage,
                          _planner_precision(r.precision), device)
    return memory, layers


def _layer_comm(run: ResolvedRun, r: RankRun, layers: list[int]) -> tuple[dict, dict]:
    """Per layer and micro-batch: the TP collectives the layers issued, seqpar's and the paper's
    (an MoE layer's own, :mod:`seqpar.tools.dryrun_experts`)."""
    mc, t, act = run.cfg.model, run.cfg.parallel.tp, 4 if r.precision == "fp32" else 2
    modes = mc.layer_recompute() or [mc.recompute] * mc.layers
    units = max(1, len(layers) * r.micro_batches)
    seqpar: dict[str, list[float]] = {}
    paper: dict[str, list[float]] = {}
    for i in layers:
        for table, comm in ((seqpar, seqpar_layer_comm(run, i, act, modes[i])), (paper, paper_comm(run, i, act))):
            for kind, (calls, nbytes) in comm.items():
                row = table.setdefault(kind, [0.0, 0.0])
                row[0], row[1] = row[0] + calls / len(layers), row[1] + nbytes / len(layers)
    measured = {row["kind"]: (row["layer_calls"] / units, row["layer_bytes"] / units)
                for row in r.comm if row["group"] == "tp" and row["layer_calls"]}
    out = {"measured": measured, "seqpar": {k: tuple(v) for k, v in seqpar.items()},
           "paper": {k: tuple(v) for k, v in paper.items()}}
    wire = {k: layer_wire_bytes({kind: x for kind, x in v.items() if kind in WIRE_FACTOR}, t) for k, v in out.items()}
    return out, wire


def required_collectives(run: ResolvedRun, r: RankRun) -> dict[tuple[str, str], tuple[str, float]]:
    """``(group, kind) -> (why, least bytes)`` for every collective this rank's step must issue: the
    layers' §4.2.2 volume over tp (under ``tp_overlap``, as ring steps), one activation per
    micro-batch each way between stages, the gradients over dp (all-reduced, or under FSDP2
    reduce-scattered and the parameters gathered: the shards times the ranks sharing them), K/V over cp."""
    mc, pc = run.cfg.model, run.cfg.parallel
    act = 4 if r.precision == "fp32" else 2
    s, b = mc.seq_len // pc.cp, run.cfg.train.micro_batch
    layers = stage_layer_ids(mc.layers, pc.pp, pc.virtual_stages, r.coords["pp"][0])
    need: dict[tuple[str, str], tuple[str, float]] = {}
    paper: dict[str, float] = {}
    for i in layers:  # §4.2.2's volume of this rank's layers (an MoE layer's own)
        for kind, (_, nbytes) in paper_comm(run, i, act).items():
            paper[kind] = paper.get(kind, 0) + nbytes * r.micro_batches
    what = "sequence parallelism's g / g-bar" if mc.sequence_parallel else "tensor parallelism's f / f-bar"
    if mc.sequence_parallel and pc.tp_overlap:  # each g / g-bar a ring of t-1 steps of one shard: (t-1)/t of it
        need[("tp", "send_recv")] = (f"{what} in every layer, as rings (parallel.tp_overlap)",
                                     sum(paper.values()) * (pc.tp - 1) / pc.tp)
    else:
        need.update({("tp", kind): (f"{what} in every layer", nbytes) for kind, nbytes in paper.items()})
    moe = expert_comm(run, layers, act, r.micro_batches, r.comm)
    if moe:
        units = sum(1 for i in layers if is_moe(run, i)) * r.micro_batches
        need[("ep", "all_to_all")] = ("the MoE layers' token exchange over ep", moe["formula"][1] * units)
    if pc.pp > 1:
        one = s * b * mc.hidden * act / (pc.tp if mc.sequence_parallel else 1)
        need.update({("pp", k): ("activations and their gradients between pipeline stages", r.micro_batches * one)
                     for k in ("send", "recv")})
    if pc.cp > 1:
        kind = "all_gather" if pc.cp_comm == "allgather" else "send_recv"
        need[("cp", kind)] = (f"attention's K/V exchange over cp ({pc.cp_comm})", 1)
    shards = run.dp * pc.cp
    group = "dp x cp" if pc.cp > 1 and run.dp > 1 else ("cp" if pc.cp > 1 else "dp")  # mesh.dp_cp_group
    experts = pc.ep > 1  # the routed experts' gradients go over edp instead (dryrun_experts.expert_needs)
    params = r.state["parameters"] - (r.experts["parameters"] if experts else 0)
    grads = r.state["gradients"] - (r.experts["gradients"] if experts else 0)
    if run.dp_mode == "fsdp" and shards > 1:
        compute = 2 if r.precision == "bf16" else 4
        need[(group, "all_gather")] = ("FSDP2's parameter gathers", params * shards * compute / 4)
        need[(group, "reduce_scatter")] = ("FSDP2's gradient reduce-scatters", grads * shards)
    elif run.dp > 1:
        need[(group, "all_reduce")] = ("the data-parallel gradient reduction", grads)
    return {**need, **expert_needs(run, r.experts, r.precision)}


def _problems(run: ResolvedRun, r: RankRun, check: Check) -> list[str]:
    who = f"rank {r.rank} of {r.world}"
    out = []
    if r.layers_built > check.layers_expected:
        stage = f"pipeline stage(s) {r.stages}" if run.cfg.parallel.pp > 1 else "its model"
        out.append(f"{who} builds {r.layers_built} transformer layers, but {stage} hold {check.layers_expected} of "
                   f"L={run.cfg.model.layers} (p={run.cfg.parallel.pp})")
    sent = {(row["group"], row["kind"]): row["bytes"] for row in r.comm}
    for (group, kind), (why, least) in required_collectives(run, r).items():
        got = sent.get((group, kind), 0)
        if got < least:
            what = f"no {kind}" if not got else f"{kind} of only {got:,} bytes"
            out.append(f"{who} issued {what} over {group} in one step; the layout needs at least {least:,.0f} "
                       f"bytes ({why})")
    if check.capacity is not None and check.peak > check.capacity:
        top = sorted(((v, k) for k, v, _ in check.rows if v is not None), reverse=True)[:2]
        out.append(f"{who} would run out of memory: predicted peak {check.peak / GIB:.2f} GiB > "
                   f"{check.capacity / GIB:.2f} GiB per GPU (largest: "
                   + ", ".join(f"{k} {v / GIB:.2f} GiB" for v, k in top) + ")")
    ratio = check.peak / check.planned_peak
    if check.tolerance is not None and abs(ratio - 1) > check.tolerance:
        m, part, p = max(((m, k, p) for k, m, p in check.rows if m is not None), key=lambda x: abs(x[0] - x[2]))
        out.append(f"{who} measures a peak of {check.peak / GIB:.2f} GiB, {ratio:.3f}x the planner's "
                   f"{check.planned_peak / GIB:.2f} GiB (more than {check.tolerance:.0%} off; furthest: {part} "
                   f"{human(m)} measured, {human(p)} planned)")
    return out


def check_rank(run: ResolvedRun, r: RankRun, gpu: GPU | None = None, device: str = "cuda",
               tolerance: float | None = None) -> Check:
    """The comparison and the problems of one rank (module docstring); ``device``: what the run was
    resolved for, whose attention kernels the planner's activations count; ``tolerance``: how far
    the measured peak may lie from the planner's (None: any distance)."""
    memory, layers = _stage_plan(run, r, gpu, device)
    parts = dict(memory.parts)
    measured = {"parameters": r.state["parameters"], "gradients": r.state["gradients"],
                "optimizer": r.state["optimizer"], "activations": r.saved["layers"],
                "outside_layers": r.saved["outside_layers"]}
    rows = [(k, float(measured[k]) if k in measured else None, float(parts[k])) for k in parts if k != "workspace"]
    actual = {**parts, **measured}
    actual["workspace"] = allowance(actual)
    check = Check(rows=rows + [("workspace", None, float(parts["workspace"]))], peak=float(sum(actual.values())),
                  planned_peak=float(memory.total), capacity=gpu.hbm_bytes if gpu is not None else None,
                  layers_expected=len(layers), tolerance=tolerance)
    check.layer_comm, check.layer_wire = _layer_comm(run, r, layers)
    check.expert_comm = expert_comm(run, layers, 4 if r.precision == "fp32" else 2, r.micro_batches, r.comm)
    check.problems = _problems(run, r, check)
    return check


__all__ = ["Check", "MEASURED", "VERIFY_TOLERANCE", "check_rank", "required_collectives"]
