"""The step engine with pipeline stages (``parallel.pp > 1``): this rank's stages over
:class:`~seqpar.parallel.pipeline.PipelineParallel`.

Runs one optimizer step's micro-batches through the schedule in the run's precision, evaluates
through the pipeline, and reports the first stage's measured bubble and peak saved activations
next to §4.2.3's predictions. Gradients are reduced by the pipeline itself: SP-replicated ones
summed over TP once per stage, the tied token table's two copies summed over the first/last
pair, everything averaged over dp; the clip counts the tied table once.

Timing: on CUDA the bubble needs a device synchronize after every chunk; it is taken only on
steps asked to be ``timed`` (the Trainer's log steps), never on the others.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..config import RunConfig
from ..distributed.mesh import ParallelMesh
from ..memory.whole_model import model_activation_bytes
from .engine import Batch, PrecisionRecipe, StepEngine
from ..memory import PeakActivationLedger, layers_in_flight
from .compile import compile_blocks, compile_enabled, merge_reports
from .pipeline import build_pipeline, resolve_schedule
from .tp_overlap import apply_tp_overlap


class PipelineEngine(StepEngine):
    """This rank's pipeline stages for ``cfg`` on ``mesh`` with ``accum`` micro-batches per step."""

    def __init__(self, cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: PrecisionRecipe):
        pc, mc = cfg.parallel, cfg.model
        self.cfg, self.mesh, self.accum, self.precision = cfg, mesh, accum, precision
        self.schedule = resolve_schedule(pc.pp_schedule, pc.virtual_stages)
        dtype = torch.bfloat16 if precision.master_weights else None  # stages exchange bf16 activations
        self.pipe = build_pipeline(mc, mesh, seed=cfg.train.seed, schedule=self.schedule,
                                   virtual_stages=pc.virtual_stages, n_microbatches=accum, activation_dtype=dtype,
                                   time_cuda=False)  # synchronized only on timed steps
        self.module = self.pipe.module  # an nn.ModuleList of this rank's stages
        apply_tp_overlap(self.module, pc.tp_overlap)
        if compile_enabled(cfg.train.compile, mesh.device, mc, mesh.cp_size):
            reports = [compile_blocks(part, list(part.blocks.values())) for part in self.pipe.parts]
            self.compiled = merge_reports(reports)
        self.parts, self.full_model = list(self.pipe.parts), None
        self.peak: int | None = None  # peak saved-activation bytes inside the layers, first step
        self.peak_outside: int | None = None  # saved outside the layers at that peak (§4.3's terms)

    def forward_backward(self, micro_batches: Sequence[Batch], *, timed: bool = False) -> torch.Tensor:
        """The bf16 recipe runs the stages on bf16 copies and adds their grads into the fp32
        masters before the reductions. Returns the mean loss, identical on this pipeline's ranks."""
        prec = self.precision
        tokens = torch.cat([x for x, _ in micro_batches])
        labels = torch.cat([y for _, y in micro_batches])
        weights = prec.compute_weights(self.module)
        # the first step only; what a recompute saves while backward runs is its transient, not in §4.2.3
        ledger = PeakActivationLedger(self.module, during_backward=False) if self.peak is None else None
        with prec.weights_in(self.module, weights), prec.autocast(), ledger or contextlib.nullcontext():
            loss = self.pipe.step(tokens, labels, finish=weights is None, timed=timed)
        if ledger is not None:
            self.peak, self.peak_outside = ledger.peak_layer_bytes, ledger.outside_at_layer_peak
        if weights is not None:
            prec.accumulate(self.module, weights)
            self.pipe.finish_grads()
        return loss

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.pipe.clip_grad_norm(max_norm)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Mean loss over ``batches`` (taken ``n_microbatches`` at a time through the pipeline)."""
        prec, n, device = self.precision, self.pipe.n_microbatches, self.mesh.device
        groups = [batches[i:i + n] for i in range(0, len(batches) - n + 1, n)] or [list(batches) * n]
        self.pipe.train(False)
        total = torch.zeros((), dtype=torch.float64, device=device)
        with prec.weights_in(self.module, prec.compute_weights(self.module)), prec.autocast():
            for group in groups:
                tokens = torch.cat([x for x, _ in group]).to(device)
                labels = torch.cat([y for _, y in group]).to(device)
                total += self.pipe.evaluate(tokens, labels)
        self.pipe.train(True)
        return total / len(groups)

    def parameters_line(self) -> str:
        return (f"parameters: {sum(p.numel() for p in self.module.parameters()):,} in pipeline stage(s) "
                f"{[part.index for part in self.parts]} on this rank ({self.schedule}, {self.accum} "
                f"micro-batches per step)")

    def memory_line(self) -> str:
        """This stage's peak saved activations in the layers during the first step against §4.2.3."""
        mc, pc, tc = self.cfg.model, self.cfg.parallel, self.cfg.train
        kept = model_activation_bytes(mc, t=self.mesh.tp_size, micro_batch=tc.micro_batch,
                                      activation_bytes=self.precision.activation_bytes,
                                      device=self.mesh.device.type, cp=self.mesh.cp_size)["layers"]
        per_layer = kept / mc.layers  # Table 2's bytes per layer as this config runs them
        layers = layers_in_flight(self.schedule, pp_rank=self.mesh.pp_rank, pp=self.mesh.pp_size,
                                  virtual_stages=pc.virtual_stages, layers=mc.layers,
                                  n_microbatches=self.pipe.n_microbatches)
        formula = per_layer * float(layers)
        return (f"activations: {(self.peak or 0) / 2**20:.2f} MiB peak saved in the layers of pipeline stage "
                f"{self.mesh.pp_rank}, formula {formula / 2**20:.2f} MiB = {float(layers):.3g} layers' worth "
                f"(ratio {(self.peak or 0) / formula:.3f}; §4.2.3, {self.schedule})")

    def bubble_line(self) -> str | None:
        """The first stage's measured idle fraction of the last timed step next to ``(p-1)/(m n)``."""
        timing = self.pipe.last_timing
        if timing is None:
            return None
        return (f"           pipeline bubble {timing.bubble:.3f} measured on stage {self.mesh.pp_rank} (idle / busy "
                f"time of the step), (p-1)/(m n) = {self.pipe.ideal_bubble():.3f}")

    def log_lines(self) -> list[str]:
        line = self.bubble_line()
        return [line] if line else []


__all__ = ["PipelineEngine"]
