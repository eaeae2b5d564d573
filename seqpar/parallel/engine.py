"""One step engine for every layout: what the Trainer calls, with or without pipeline stages.

A :class:`StepEngine` holds this rank's model parts and runs one optimizer step's
forward/backward over its micro-batches (gradients reduced and ready to clip), the global-norm
clip, the evaluation forward, and the report lines of what it measured. Like torchtitan's
``model_parts``, checkpoints, clipping and the optimizer see one shape: ``module`` (all of this
rank's parameters) and ``parts`` (the GPT, or this rank's pipeline stages, with their RNG
``streams``). Only the engine knows about pipelines:

* :class:`~seqpar.parallel.plain_engine.PlainEngine`: the GPT over :class:`DataParallel`;
* :class:`~seqpar.parallel.pipeline_engine.PipelineEngine`: stages over :class:`PipelineParallel`;
* :func:`~seqpar.parallel.engines.build_engine` picks one for a run.

The precision recipe and the activation probe come from the caller and are typed structurally
(:class:`PrecisionRecipe`, :class:`ActivationProbe`), so this package depends on nothing above it.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import torch
import torch.nn as nn

from ..model.config import GPTConfig
from .compile import CompileReport

Batch = tuple[torch.Tensor, torch.Tensor]  # (tokens, labels), each [b, s]


class PrecisionRecipe(Protocol):
    """How a step computes (``seqpar.train.precision.Precision`` is one)."""

    name: str
    master_weights: bool
    activation_bytes: int

    def autocast(self) -> AbstractContextManager: ...
    def compute_weights(self, model: nn.Module) -> dict[str, torch.Tensor] | None: ...
    def weights_in(self, model: nn.Module, weights: dict[str, torch.Tensor] | None) -> AbstractContextManager: ...
    def accumulate(self, model: nn.Module, weights: dict[str, torch.Tensor] | None) -> None: ...


class ActivationProbe(Protocol):
    """Measures the saved activations of the first forward (``seqpar.memory.probe``)."""

    def measure(self) -> AbstractContextManager: ...
    def line(self, cfg: GPTConfig, *, t: int, micro_batch: int, activation_bytes: int, cp: int = 1) -> str: ...


class StepEngine:
    """The interface the Trainer calls; see the module docstring."""

    compiled: "CompileReport | None" = None  # what train.compile compiled (seqpar.parallel.compile)

    module: nn.Module               # every parameter of this rank (the optimizer's)
    parts: list[nn.Module]          # the model parts checkpoints hold
    full_model: nn.Module | None    # the whole GPT when this rank holds it (sampling), else None

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
        """What was compiled and how long compilation took (once, after the first step)."""
        if self.compiled is None:
            return None
        self.compiled.seconds = seconds
        return self.compiled.line()

    def log_lines(self) -> list[str]:
        """Extra lines for a log step (the pipeline bubble)."""
        return []


__all__ = ["ActivationProbe", "Batch", "PrecisionRecipe", "StepEngine"]
