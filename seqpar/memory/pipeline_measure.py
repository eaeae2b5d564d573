"""``seqpar memory --measure`` for pipeline layouts: the first stage's peak during one schedule step.

With ``parallel.pp = p > 1`` the per-GPU figure of §4.2.3 is what the *first* pipeline stage holds
at its peak, ``L`` layers' worth for 1F1B (``p`` micro-batches of its ``L/p`` layers in flight)
times ``1 + (p-1)/(pm)`` with ``m`` interleaved chunks. This runs one training step of the model
on ``p x t`` gloo ranks (bf16, math attention, dropout 0.1, as the per-layer measurement), with
:func:`micro_batches` micro-batches (enough for the schedule to reach its peak),
and reads the peak saved-activation bytes inside the layers of the first stage
(:class:`seqpar.parallel.PeakActivationLedger`, leaving out what a recompute saves during
backward: that transient of one unit is not part of the formulas), for TP + SP and TP + SP +
selective.
"""
from __future__ import annotations

import dataclasses

from ..distributed.local import run_local
from ..model.config import GPTConfig
from .formulas import ModelShape, per_gpu_bytes

TECHNIQUES = {"tp_sp": ("TP + SP", "none"), "tp_sp_selective": ("TP + SP + selective", "selective")}


def _stored_ledger(module):
    """A :class:`PeakActivationLedger` that leaves out what a recompute saves while backward runs
    (the transient of one recomputed unit, which Table 2 and §4.2.3 do not count)."""
    import torch

    from ..parallel import PeakActivationLedger

    class StoredLedger(PeakActivationLedger):
        def _pack(self, saved):
            if torch._C._current_graph_task_id() != -1:  # inside backward: a recompute's transient
                return saved
            return super()._pack(saved)

    return StoredLedger(module)


def micro_batches(p: int, m: int) -> int:
    """Micro-batches per measured step: ``p`` for 1F1B (it holds ``p`` at its peak), ``2p`` when
    interleaved (the warm-up of ``(m-1)p + 2(p-1) + 1`` chunks needs that many to start)."""
    return p if m == 1 else 2 * p


def _rank_main(rank: int, world: int, base: GPTConfig, t: int, p: int, m: int, b: int) -> dict[str, int]:
    import torch

    from ..distributed import init_parallel
    from ..parallel import build_pipeline

    mesh = init_parallel(tp=t, pp=p, backend="gloo")
    out = {}
    for tech, (_, recompute) in TECHNIQUES.items():
        cfg = dataclasses.replace(base, dtype="bfloat16", attention="math", dropout=0.1, attention_dropout=0.1,
                                  sequence_parallel=True, recompute=recompute, recompute_layers=None)
        n = micro_batches(p, m)
        pipe = build_pipeline(cfg, mesh, seed=0, virtual_stages=m, n_microbatches=n)
        tokens = torch.randint(0, cfg.vocab_size, (b * n, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        with _stored_ledger(pipe.module) as ledger:
            pipe.step(tokens, tokens)
        out[tech] = ledger.peak_layer_bytes if mesh.pp_rank == 0 else 0
        del pipe, ledger
    return out


def measure_first_stage(model: GPTConfig, shape: ModelShape, timeout_s: float, rank_timeout_s: float) -> dict[str, int]:
    """Peak bytes the first stage keeps inside its layers during one step (the largest over its TP ranks)."""
    ranks = run_local(_rank_main, shape.p * shape.t, model, shape.t, shape.p, shape.m, shape.b, timeout=timeout_s,
                      collective_timeout=rank_timeout_s)
    return {tech: max(r[tech] for r in ranks) for tech in TECHNIQUES}


def first_stage_table(shape: ModelShape, measured: dict[str, int]) -> str:
    """Markdown rows: formula per GPU (first stage, §4.2.3) against the measured peak."""
    sched = "interleaved" if shape.m > 1 else "1F1B"
    lines = [f"First pipeline stage at its peak during one {sched} step (p={shape.p}, m={shape.m}, "
             f"{micro_batches(shape.p, shape.m)} micro-batches of {shape.b}; measured on {shape.p * shape.t} "
             f"gloo ranks):", "",
             "| technique | formula per GPU (§4.2.3) | measured peak (bytes) | measured / formula |", "|---|---|---|---|"]
    for tech, (label, _) in TECHNIQUES.items():
        formula = per_gpu_bytes(shape, tech)
        lines.append(f"| {label} | {formula:,.0f} | {measured[tech]:,} | {measured[tech] / formula:.4f} |")
    return "\n".join(lines)


__all__ = ["first_stage_table", "measure_first_stage"]
