"""What the Trainer does differently with pipeline stages (``parallel.pp > 1``).

:class:`PipelineRun` holds this rank's stages (:class:`seqpar.parallel.PipelineParallel`) and
runs one optimizer step's micro-batches through the schedule in the run's precision, evaluates
through the pipeline, and reports the first stage's measured bubble and peak saved activations
next to §4.2.3's predictions. Gradients are reduced by the pipeline itself: SP-replicated ones
summed over TP once per stage, the tied token table's two copies summed over the first/last
pair, everything averaged over dp; the clip norm sums squares over pp, dp and tp with the tied
table counted once.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn as nn

from ..config import RunConfig
from ..distributed.mesh import ParallelMesh
from ..memory.whole_model import model_activation_bytes
from ..parallel import PeakActivationLedger, build_pipeline, layers_in_flight, resolve_schedule
from ..data import Batch
from .precision import Precision


class PipelineRun:
    """This rank's pipeline stages for ``cfg`` on ``mesh`` with ``accum`` micro-batches per step."""

    def __init__(self, cfg: RunConfig, mesh: ParallelMesh, accum: int, precision: Precision):
        pc, mc = cfg.parallel, cfg.model
        self.cfg, self.mesh, self.precision = cfg, mesh, precision
        self.schedule = resolve_schedule(pc.pp_schedule, pc.virtual_stages)
        dtype = torch.bfloat16 if precision.master_weights else None  # stages exchange bf16 activations
        self.pipe = build_pipeline(mc, mesh, seed=cfg.train.seed, schedule=self.schedule,
                                   virtual_stages=pc.virtual_stages, n_microbatches=accum, activation_dtype=dtype,
                                   time_cuda=mesh.device.type == "cuda")
        self.module: nn.Module = self.pipe.module  # the optimizer's and the checkpoints' parameters
        self.parts = self.pipe.parts
        self.peak: int | None = None  # peak saved-activation bytes inside the layers, first step

    @property
    def streams(self) -> list:
        return [part.rng for part in self.parts]

    def forward_backward(self, micro_batches: Sequence[Batch]) -> torch.Tensor:
        """Forward and backward of one step's micro-batches through the schedule; returns the mean
        loss (float64, identical on every rank of this pipeline). The bf16 recipe runs the stages
        on bf16 copies and adds their grads into the fp32 masters before the reductions."""
        prec = self.precision
        tokens = torch.cat([x for x, _ in micro_batches])
        labels = torch.cat([y for _, y in micro_batches])
        weights = prec.compute_weights(self.module)
        ledger = PeakActivationLedger(self.module) if self.peak is None else None  # the first step only
        with prec.weights_in(self.module, weights), prec.autocast(), ledger or contextlib.nullcontext():
            loss = self.pipe.step(tokens, labels, finish=weights is None)
        if ledger is not None:
            self.peak = ledger.peak_layer_bytes
        if weights is not None:
            prec.accumulate(self.module, weights)
            self.pipe.finish_grads()
        return loss

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.pipe.clip_grad_norm(max_norm)

    @torch.no_grad()
    def evaluate(self, evals: Sequence[Batch]) -> torch.Tensor:
        """Mean loss over ``evals`` (taken ``n_microbatches`` at a time through the pipeline)."""
        prec, n = self.precision, self.pipe.n_microbatches
        groups = [evals[i:i + n] for i in range(0, len(evals) - n + 1, n)] or [list(evals) * n]
        self.pipe.train(False)
        total = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        with prec.weights_in(self.module, prec.compute_weights(self.module)), prec.autocast():
            for group in groups:
                tokens = torch.cat([x for x, _ in group]).to(self.mesh.device)
                labels = torch.cat([y for _, y in group]).to(self.mesh.device)
                total += self.pipe.evaluate(tokens, labels)
        self.pipe.train(True)
        return total / len(groups)

    def memory_line(self) -> str:
        """This stage's peak saved activations in the layers during the first step against §4.2.3."""
        mc, pc, tc = self.cfg.model, self.cfg.parallel, self.cfg.train
        kept = model_activation_bytes(mc, t=self.mesh.tp_size, micro_batch=tc.micro_batch,
                                      activation_bytes=self.precision.activation_bytes,
                                      device=self.mesh.device.type)["layers"]
        per_layer = kept / mc.layers  # Table 2's bytes per layer as this config runs them
        layers = layers_in_flight(self.schedule, pp_rank=self.mesh.pp_rank, pp=self.mesh.pp_size,
                                  virtual_stages=pc.virtual_stages, layers=mc.layers,
                                  n_microbatches=self.pipe.n_microbatches)
        formula = per_layer * float(layers)
        return (f"activations: {(self.peak or 0) / 2**20:.2f} MiB peak saved in the layers of pipeline stage "
                f"{self.mesh.pp_rank}, formula {formula / 2**20:.2f} MiB = {float(layers):.3g} layers' worth "
                f"(ratio {(self.peak or 0) / formula:.3f}; §4.2.3, {self.schedule})")

    def bubble_line(self) -> str | None:
        """The first stage's measured idle fraction of the last step next to ``(p-1)/(m n)``."""
        timing = self.pipe.last_timing
        if timing is None:
            return None
        return (f"           pipeline bubble {timing.bubble:.3f} measured on stage {self.mesh.pp_rank} (idle / busy "
                f"time of the step), (p-1)/(m n) = {self.pipe.ideal_bubble():.3f}")


__all__ = ["PipelineRun"]
