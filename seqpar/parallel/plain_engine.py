"""The step engine without pipeline stages: the whole GPT on this rank, over ddp or fsdp.

Per optimizer step: each micro-batch's forward and backward in the run's precision (loss scaled
by 1/accum; DDP's ``no_sync`` / FSDP's deferred reduce-scatter before the last), then
:meth:`DataParallel.after_backward` (the bf16 recipe's fp32 dp all-reduce under ddp, bucket by
bucket under the last backward; SP grads summed over TP). The clip is :func:`seqpar.parallel.grads.clip_grad_norm` over tp and dp.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ..config import RunConfig
from ..distributed.mesh import ParallelMesh
from ..model import GPT
from .compile import compile_blocks, compile_enabled
from .data_parallel import DataParallel
from .fsdp import reshard
from .engine import ActivationProbe, Batch, PrecisionRecipe, StepEngine
from .tp_overlap import apply_tp_overlap


class PlainEngine(StepEngine):
    """The GPT of ``cfg.model`` on ``mesh`` (pp = 1), wrapped for data parallelism."""

    def __init__(self, cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: PrecisionRecipe,
                 probe: Callable[[nn.Module, torch.device], ActivationProbe] | None = None):
        self.cfg, self.mesh, self.accum, self.precision = cfg, mesh, accum, precision
        self.model = GPT(cfg.model, mesh, seed=cfg.train.seed, cp_comm=cfg.parallel.cp_comm)
        apply_tp_overlap(self.model, cfg.parallel.tp_overlap)  # TP/SP -> overlap -> compile -> data parallel
        if compile_enabled(cfg.train.compile, mesh.device, cfg.model, mesh.cp_size):  # after TP/SP and recompute, before FSDP2
            self.compiled = compile_blocks(self.model)
        mode = cfg.parallel.data_parallel_mode(mesh.dp_size)
        self.data_parallel = DataParallel(self.model, mesh, mode, precision=precision.name,
                                          master_weights=precision.master_weights,
                                          reshard_after_forward=cfg.parallel.reshard_after_forward,
                                          bucket_mib=cfg.parallel.bucket_mib)
        # under context parallelism this rank's forward sees its own chunks only: no sampling here
        self.module, self.parts = self.model, [self.model]
        self.full_model = self.model if mesh.cp_size == 1 else None
        self.probe = probe(self.model, mesh.device) if probe is not None else None

    def _measure(self):
        return self.probe.measure() if self.probe is not None else contextlib.nullcontext()

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
        """After a forward with no backward (evaluation, sampling): under FSDP2 the root unit keeps
        its parameters gathered, so they are resharded here; checkpoints and the optimizer then
        see the dp shards again."""
        if self.data_parallel.sharded:
            reshard(self.model)

    def parameters_line(self) -> str:
        return (f"parameters: {self.model.num_parameters():,} in the full model, "
                f"{self.model.num_parameters(False):,} on this rank")

    def memory_line(self) -> str:
        return self.probe.line(self.cfg.model, t=self.mesh.tp_size, micro_batch=self.cfg.train.micro_batch,
                               activation_bytes=self.precision.activation_bytes, cp=self.mesh.cp_size)


__all__ = ["PlainEngine"]
