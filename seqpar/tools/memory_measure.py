"""``seqpar memory --measure``: the bytes a small model really keeps, on gloo ranks of this machine.

:func:`measure` builds the model on ``t`` ranks once per Table 2 row and reads what each layer
keeps for backward (:class:`seqpar.memory.ActivationLedger`). For pipeline layouts,
:func:`measure_first_stage` reads the first stage's peak during one schedule step: with ``parallel.pp = p > 1`` the per-GPU figure of §4.2.3 is what the *first* pipeline stage holds
at its peak, ``L`` layers' worth for 1F1B (``p`` micro-batches of its ``L/p`` layers in flight)
times ``1 + (p-1)/(pm)`` with ``m`` interleaved chunks. This runs one training step of the model
on ``p x t`` gloo ranks (bf16, the configured attention, dropout 0.1, as the per-layer measurement), with
:func:`micro_batches` micro-batches (enough for the schedule to reach its peak),
and reads the peak saved-activation bytes inside the layers of the first stage
(:class:`seqpar.memory.PeakActivationLedger`, leaving out what a recompute saves during
backward: that transient of one unit is not part of the formulas), for TP + SP and TP + SP +
selective.
"""
from __future__ import annotations

import dataclasses

import sys

from ..distributed.local import run_local
from ..memory.formulas import ModelShape, Technique, per_gpu_bytes
from ..memory.whole_model import layer_bytes
from ..model.config import GPTConfig

TECHNIQUES = {"tp_sp": ("TP + SP", "none"), "tp_sp_selective": ("TP + SP + selective", "selective")}
# Table 2 row -> (label, GPTConfig.sequence_parallel, GPTConfig.recompute) that realises it
ROWS: dict[Technique, tuple[str, bool, str]] = {
    "tp": ("TP (baseline)", False, "none"),
    "tp_sp": ("TP + SP", True, "none"),
    "tp_selective": ("TP + selective", False, "selective"),
    "tp_sp_selective": ("TP + SP + selective", True, "selective"),
    "full": ("full recompute", False, "full"),
}
RANK_TIMEOUT_S = 120  # a rank stuck in a collective fails the run instead of hanging it
RUN_TIMEOUT_S = 1800  # a measurement still running after this is killed


def row_config(base: GPTConfig, tech: str) -> GPTConfig:
    """The config a Table 2 row is measured with: bf16, dropout 0.1, the row's SP and uniform
    recompute, and the file's own attention kernel (``model.attention``)."""
    _, sp, recompute = ROWS[tech]
    return dataclasses.replace(base, dtype="bfloat16", dropout=0.1, attention_dropout=0.1, sequence_parallel=sp,
                               recompute=recompute, recompute_method="uniform", recompute_num_layers=1,
                               recompute_layers=None)


def measured_formula(base: GPTConfig, shape: ModelShape) -> dict[str, int]:
    """Per-layer bytes each row should keep on these CPU ranks, for the configured attention kernel
    (:func:`seqpar.memory.whole_model.layer_bytes`; Table 2 itself for ``attention: math``)."""
    return {tech: round(layer_bytes(row_config(base, tech), ROWS[tech][2], s=shape.s, b=shape.b, t=shape.t, act=2,
                                    device="cpu")) for tech in ROWS}


def _layer_rank(rank: int, t: int, base: GPTConfig, b: int) -> dict[str, list[int]]:
    """One gloo rank: build the model once per technique and return each layer's saved bytes."""
    import torch

    from ..distributed import init_parallel
    from ..memory.ledger import ActivationLedger
    from ..model import GPT

    mesh = init_parallel(tp=t, backend="gloo")  # over the group run_local started
    out: dict[str, list[int]] = {}
    for i, (tech, (label, _, _)) in enumerate(ROWS.items()):
        cfg = row_config(base, tech)
        net = GPT(cfg, mesh, seed=0)
        tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        with ActivationLedger(net) as ledger:
            net(tokens, tokens)  # forward only: the ledger sees what backward would need
        out[tech] = list(ledger.per_layer().values())
        if rank == 0:
            print(f"  [{i + 1}/{len(ROWS)}] {label}: {max(out[tech]) / 2**20:.2f} MiB per layer (rank 0)",
                  file=sys.stderr, flush=True)
        del net, ledger
    return out


def measure(model: GPTConfig, shape: ModelShape) -> dict[str, int]:
    """Per-layer bytes each technique keeps (the largest over layers and ranks), on ``shape.t`` gloo
    ranks started by :func:`~seqpar.distributed.local.run_local`."""
    ranks = run_local(_layer_rank, shape.t, model, shape.b, timeout=RUN_TIMEOUT_S,
                      collective_timeout=RANK_TIMEOUT_S)
    return {tech: max(max(r[tech]) for r in ranks) for tech in ROWS}


def micro_batches(p: int, m: int) -> int:
    """Micro-batches per measured step: ``p`` for 1F1B (it holds ``p`` at its peak), ``2p`` when
    interleaved (the warm-up of ``(m-1)p + 2(p-1) + 1`` chunks needs that many to start)."""
    return p if m == 1 else 2 * p


def _rank_main(rank: int, world: int, base: GPTConfig, t: int, p: int, m: int, b: int) -> dict[str, int]:
    import torch

    from ..distributed import init_parallel
    from ..memory.peak import PeakActivationLedger
    from ..parallel import build_pipeline

    mesh = init_parallel(tp=t, pp=p, backend="gloo")
    out = {}
    for tech, (_, recompute) in TECHNIQUES.items():
        cfg = dataclasses.replace(base, dtype="bfloat16", dropout=0.1, attention_dropout=0.1,
                                  sequence_parallel=True, recompute=recompute, recompute_layers=None)
        n = micro_batches(p, m)
        pipe = build_pipeline(cfg, mesh, seed=0, virtual_stages=m, n_microbatches=n)
        tokens = torch.randint(0, cfg.vocab_size, (b * n, cfg.seq_len), generator=torch.Generator().manual_seed(0))
        with PeakActivationLedger(pipe.module, during_backward=False) as ledger:
            pipe.step(tokens, tokens)
        out[tech] = ledger.peak_layer_bytes if mesh.pp_rank == 0 else 0
        del pipe, ledger
    return out


def measure_first_stage(model: GPTConfig, shape: ModelShape, timeout_s: float = RUN_TIMEOUT_S,
                        rank_timeout_s: float = RANK_TIMEOUT_S) -> dict[str, int]:
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


__all__ = ["ROWS", "first_stage_table", "measure", "measure_first_stage", "measured_formula", "row_config"]
