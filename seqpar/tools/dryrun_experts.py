"""What a mixture of experts changes in a dry run's expectations: per-layer formulas and needed bytes.

An MoE layer's TP collectives are attention's half of a dense layer's (plus the MLP's half for
shared experts, plus expert-TP's gathers, plus the router's small sums over the TP group:
:func:`seqpar.memory.moe.moe_layer_comm`); under expert parallelism it issues all-to-alls over ep
(:func:`seqpar.memory.moe.expert_layer_comm`: the counts, the rows out and back, forward and
backward), and the routed experts' gradients are reduced over their expert-data-parallel group
(edp), not over dp. The all-to-all bytes are the balanced-routing figures the planner assumes, and
the dry run routes that way (:mod:`seqpar.tools.dryrun_routing`), so measured and formula agree to
the byte.
"""
from __future__ import annotations

from ..memory.comm import layer_comm, paper_layer_comm
from ..memory.moe import expert_layer_comm, moe_layer_comm
from ..train.resolve import ResolvedRun


def is_moe(run: ResolvedRun, layer: int) -> bool:
    moe = run.cfg.model.moe
    return moe is not None and moe.is_moe_layer(layer)


def layer_dims(run: ResolvedRun, act: int) -> dict:
    """The ``s, b, t, act`` of one layer's collectives on a rank of ``run``."""
    mc, pc = run.cfg.model, run.cfg.parallel
    return dict(s=mc.seq_len // pc.cp, b=run.cfg.train.micro_batch, t=pc.tp, act=act)


def seqpar_layer_comm(run: ResolvedRun, layer: int, act: int, recompute: str) -> dict[str, tuple[int, int]]:
    """TP collectives seqpar's layer ``layer`` issues per micro-batch (dense or MoE)."""
    mc, dims = run.cfg.model, layer_dims(run, act)
    if is_moe(run, layer):
        return moe_layer_comm(mc, **dims, recompute=recompute)
    return layer_comm(**dims, h=mc.hidden, sequence_parallel=mc.sequence_parallel, recompute=recompute)


def paper_comm(run: ResolvedRun, layer: int, act: int) -> dict[str, tuple[int, int]]:
    """§4.2.2's TP collectives of layer ``layer`` per micro-batch: an MoE layer without TP-split
    experts (shared experts or expert-TP) has attention's half of them."""
    mc = run.cfg.model
    paper = paper_layer_comm(**layer_dims(run, act), h=mc.hidden, sequence_parallel=mc.sequence_parallel)
    if is_moe(run, layer) and not (mc.moe.shared_experts or mc.moe.expert_tp):
        return {kind: (c // 2, n // 2) for kind, (c, n) in paper.items()}
    return paper


def expert_comm(run: ResolvedRun, layers: list[int], act: int, micro_batches: int,
                comm: list[dict]) -> dict[str, tuple[float, float]]:
    """All-to-alls over ep per MoE layer and micro-batch: ``"measured"`` (those the layers issued)
    and ``"formula"`` (:func:`~seqpar.memory.moe.expert_layer_comm`), each ``(calls, bytes)``;
    empty without ep or without MoE layers on this rank."""
    mc, ep = run.cfg.model, run.cfg.parallel.ep
    moe = [i for i in layers if is_moe(run, i)]
    if ep == 1 or not moe:
        return {}
    modes = mc.layer_recompute() or [mc.recompute] * mc.layers
    calls = total = 0.0
    for i in moe:
        c, n = expert_layer_comm(mc, **layer_dims(run, act), ep=ep, recompute=modes[i])["all_to_all"]
        calls, total = calls + c / len(moe), total + n / len(moe)
    units = len(moe) * micro_batches
    got = [(row["layer_calls"], row["layer_bytes"]) for row in comm if (row["group"], row["kind"]) == ("ep", "all_to_all")]
    measured = (got[0][0] / units, got[0][1] / units) if got else (0.0, 0.0)
    return {"measured": measured, "formula": (calls, total)}


def expert_needs(run: ResolvedRun, experts: dict[str, int], precision: str) -> dict[tuple[str, str], tuple[str, float]]:
    """``(group, kind) -> (why, least bytes)`` the routed experts (``experts``: their parameter and
    gradient bytes on this rank) need over edp (> 1):
    all-reduced (ddp, pipeline stages), or under FSDP2 gathered and reduce-scattered over edp."""
    pc = run.cfg.parallel
    edp = run.dp * pc.cp // pc.ep
    if pc.ep == 1 or edp == 1 or not experts["gradients"]:
        return {}
    if run.dp_mode == "fsdp" and pc.pp == 1:
        compute = 2 if precision == "bf16" else 4
        return {("edp", "all_gather"): ("FSDP2's gathers of the experts over edp",
                                        experts["parameters"] * edp * compute / 4),
                ("edp", "reduce_scatter"): ("FSDP2's reduce-scatters of the experts' gradients over edp",
                                            experts["gradients"] * edp)}
    return {("edp", "all_reduce"): ("the experts' gradient reduction over edp", experts["gradients"])}


__all__ = ["expert_comm", "expert_needs", "is_moe", "layer_dims", "paper_comm", "seqpar_layer_comm"]
