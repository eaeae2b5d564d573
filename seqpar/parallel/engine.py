"""The step engine: what the Trainer calls for one optimizer step, with or without pipeline stages.

A :class:`StepEngine` holds this rank's model parts, with parallelism applied by the one recipe
(:func:`seqpar.parallel.apply.apply_parallelism`), and runs a step's forward/backward over its
micro-batches (gradients reduced and ready to clip), the global-norm clip, the evaluation forward
and the report lines of what it measured. As torchtitan's ``model_parts``: checkpoints, clipping
and the optimizer see one shape, ``module`` (every parameter of this rank) and ``parts`` (the
GPT, or this rank's pipeline stages, with their RNG ``streams``). Only the engine knows about
pipelines:

* :class:`PlainEngine` (``pp = 1``): the GPT over FSDP2 or DDP. Per micro-batch: forward and
  backward in the run's precision, the loss scaled by 1/accum (DDP's ``no_sync`` / FSDP's
  deferred reduce-scatter before the last); then the dp reductions and the SP grads summed over TP.
* :class:`PipelineEngine` (``pp > 1``): this rank's stages over
  :class:`~seqpar.parallel.pipeline.PipelineParallel`, which reduces its own gradients (SP grads
  over TP per stage, the tied token table over the first/last pair, everything over dp but the
  routed experts, which go over their edp group as in the plain step). On CUDA
  the bubble is timed (a synchronize per chunk) only on ``timed`` steps.
* :func:`build_engine` picks one for a resolved run.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn as nn

from ..config import RunConfig
from ..distributed.mesh import ParallelMesh, expert_parallel
from ..memory import PeakActivationLedger, layers_in_flight
from ..memory.probe import ActivationProbe
from ..memory.whole_model import model_activation_bytes
from ..model import GPT
from ..sharding import local_tensor
from .apply import Applied, apply_parallelism
from .compile import CompileReport
from ..model.moe import moe_layers
from .expert_grads import finish_moe_step, load_lines
from .fsdp import reshard
from .pipeline import build_pipeline, resolve_schedule
from .precision import Precision

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), each [b, s]


class StepEngine:
    """The interface the Trainer calls; see the module docstring."""

    compiled: CompileReport | None = None  # what train.compile compiled
    applied: Applied                       # what the recipe applied to the parts, in order
    module: nn.Module                      # every parameter of this rank (the optimizer's)
    parts: list[nn.Module]                 # the model parts checkpoints hold
    full_model: nn.Module | None           # the whole GPT when this rank holds it (sampling), else None

    def __init__(self, cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: Precision):
        self.cfg, self.mesh, self.accum, self.precision = cfg, mesh, accum, precision

    @property
    def streams(self) -> list:
        """The parts' RNG streams (checkpoints save and restore them)."""
        return [part.rng for part in self.parts]

    def forward_backward(self, micro_batches: Sequence[Batch], *, timed: bool = False) -> torch.Tensor:
        """Forward and backward over one optimizer step's micro-batches, gradients reduced over
        every group (ready to clip). Returns this rank's mean loss, a float64 device scalar (no
        host sync). ``timed``: measure what the engine reports on log steps (may synchronize)."""
        raise NotImplementedError

    def clip(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm before clipping (clipped in place when ``max_norm > 0``)."""
        raise NotImplementedError

    def evaluate(self, batches: Sequence[Batch]) -> torch.Tensor:
        """This rank's mean held-out loss over ``batches`` (float64 device scalar)."""
        raise NotImplementedError

    def after_forward_only(self) -> None:
        """Called after a forward with no backward (evaluation, sampling) on every rank: put the
        parameters back as the optimizer and checkpoints know them."""

    def parameters_line(self) -> str:
        raise NotImplementedError

    def memory_line(self) -> str:
        """What the first step's forward kept for backward, against the formula."""
        raise NotImplementedError

    def compile_line(self, seconds: float | None = None) -> str | None:
        """What was compiled and how long compilation took (once, after the first step); under
        ``train.compile=auto`` on a GPU, why an MoE model was not compiled."""
        if self.compiled is None:
            if self.cfg.model.moe is not None and self.cfg.train.compile == "auto" and self.mesh.device.type == "cuda":
                return ("compile: auto runs MoE blocks eagerly (their token counts and all-to-all splits are "
                        "data-dependent)")
            return None
        self.compiled.seconds = seconds
        return self.compiled.line()

    def log_lines(self) -> list[str]:
        """Extra lines for a log step (the pipeline bubble)."""
        return []


class PlainEngine(StepEngine):
    """The GPT of ``cfg.model`` on ``mesh`` (pp = 1), wrapped for data parallelism. ``probe``:
    measure the first forward's saved activations (the ``activations:`` line)."""

    def __init__(self, cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: Precision, probe: bool = True):
        super().__init__(cfg, mesh, accum=accum, precision=precision)
        self.model = GPT(cfg.model, mesh, seed=cfg.train.seed, cp_comm=cfg.parallel.cp_comm)
        self.applied = apply_parallelism([self.model], cfg, mesh, precision=precision)
        self.compiled, self.data_parallel = self.applied.compiled, self.applied.data_parallel
        # under context parallelism this rank's forward sees its own chunks only: no sampling here
        self.module, self.parts = self.model, [self.model]
        self.full_model = self.model if mesh.cp_size == 1 else None
        self.probe = ActivationProbe(self.model, mesh.device) if probe else None

    def _measure(self):
        probe = self.probe  # the first forward only: later steps do not call into the probe at all
        return probe.measure() if probe is not None and probe.measured is None else contextlib.nullcontext()

    def forward_backward(self, micro_batches: Sequence[Batch], *, timed: bool = False) -> torch.Tensor:
        """Under the bf16 recipe each micro-batch runs on bf16 copies made once per step, their
        grads added into the fp32 masters and reduced over dp in fp32 afterwards."""
        prec, dp = self.precision, self.data_parallel
        weights = prec.compute_weights(self.model)  # bf16 copies, once per optimizer step (bf16 only)
        dp.begin_step(weights)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for micro, (tokens, labels) in enumerate(micro_batches):
            with dp.micro_batch(micro, self.accum), prec.weights_in(self.model, weights):
                with prec.autocast(), self._measure():
                    loss = dp.module(tokens, labels)
                (loss / self.accum).backward()
            prec.accumulate(self.model, weights)
            loss_sum += loss.detach().double() / self.accum
        dp.after_backward()
        return loss_sum

    def clip(self, max_norm: float) -> torch.Tensor:
        return self.data_parallel.clip(max_norm)

    def log_lines(self) -> list[str]:
        """Per MoE layer, the last step's min / max tokens per expert."""
        return load_lines(self.model)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[Batch]) -> torch.Tensor:
        prec, device = self.precision, self.mesh.device
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=device)
        with prec.weights_in(self.model, prec.compute_weights(self.model)), prec.autocast():
            for tokens, labels in batches:
                total += self.model(tokens.to(device), labels.to(device)).double()
        self.model.train()
        self.after_forward_only()
        return total / len(batches)

    def after_forward_only(self) -> None:
        """Under FSDP2 the root unit keeps its parameters gathered after a forward; with no
        backward to reshard them they are resharded here, so checkpoints and the optimizer see
        the dp shards again."""
        if self.data_parallel.sharded:
            reshard(self.model)

    def parameters_line(self) -> str:
        here = sum(local_tensor(p).numel() for p in self.model.parameters())  # FSDP: this rank's dp shard
        return f"parameters: {self.model.num_parameters():,} in the full model, {here:,} on this rank"

    def memory_line(self) -> str:
        return self.probe.line(self.cfg.model, t=self.mesh.tp_size, micro_batch=self.cfg.train.micro_batch,
                               activation_bytes=self.precision.activation_bytes, cp=self.mesh.cp_size)


class PipelineEngine(StepEngine):
    """This rank's pipeline stages for ``cfg`` on ``mesh`` with ``accum`` micro-batches per step;
    reports the first step's peak saved activations and the measured bubble against §4.2.3."""

    def __init__(self, cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: Precision):
        super().__init__(cfg, mesh, accum=accum, precision=precision)
        pc, mc = cfg.parallel, cfg.model
        self.schedule = resolve_schedule(pc.pp_schedule, pc.virtual_stages)
        dtype = torch.bfloat16 if precision.master_weights else None  # stages exchange bf16 activations
        self.pipe = build_pipeline(mc, mesh, seed=cfg.train.seed, schedule=self.schedule,
                                   virtual_stages=pc.virtual_stages, n_microbatches=accum, activation_dtype=dtype,
                                   time_cuda=False)  # synchronized only on timed steps
        self.module = self.pipe.module  # an nn.ModuleList of this rank's stages
        self.applied = apply_parallelism(self.pipe.parts, cfg, mesh, data_parallel=False)
        self.compiled = self.applied.compiled
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
        for _, layer in moe_layers(self.module):  # the loss is scaled by 1/n on the last stage only: the
            layer.cell.value = torch.tensor(1.0 / self.pipe.n_microbatches)  # MoE losses take the same scale
        # the first step only; what a recompute saves while backward runs is its transient, not in §4.2.3
        ledger = PeakActivationLedger(self.module, during_backward=False) if self.peak is None else None
        with prec.weights_in(self.module, weights), prec.autocast(), ledger or contextlib.nullcontext():
            loss = self.pipe.step(tokens, labels, finish=weights is None, timed=timed)
        if ledger is not None:
            self.peak, self.peak_outside = ledger.peak_layer_bytes, ledger.outside_at_layer_peak
        if weights is not None:
            prec.accumulate(self.module, weights)
            self.pipe.finish_grads()
        finish_moe_step(self.module, self.mesh.dp_group)  # this stage's MoE layers: load, balancing bias
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
        here = sum(local_tensor(p).numel() for p in self.module.parameters())  # FSDP: this rank's dp shard
        return (f"parameters: {here:,} in pipeline stage(s) "
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
        """The measured bubble, and the tokens per expert of this rank's MoE layers."""
        line = self.bubble_line()
        return ([line] if line else []) + load_lines(self.module)


def build_engine(cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: Precision,
                 probe: bool = True) -> StepEngine:
    """The engine of a resolved ``cfg`` on ``mesh``: pipeline stages when ``mesh.pp_size > 1``,
    else the GPT over ddp / fsdp (``probe``: measure the first forward's saved activations)."""
    mesh = expert_parallel(mesh, cfg.parallel.ep)  # ep carved from dp x cp in each stage (collective: every rank)
    if mesh.pp_size > 1:
        return PipelineEngine(cfg, mesh, accum=accum, precision=precision)
    return PlainEngine(cfg, mesh, accum=accum, precision=precision, probe=probe)


__all__ = ["Batch", "PipelineEngine", "PlainEngine", "StepEngine", "build_engine"]
