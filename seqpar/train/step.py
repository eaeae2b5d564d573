"""One optimizer step: the Trainer's, and the one the tools run when they observe it (``seqpar.tools``).

:func:`run_step`, on every rank: the engine's forward/backward over the step's micro-batches
(:mod:`seqpar.parallel.engine` describes what happens inside it: micro-batches, precision,
reductions over dp and TP) -> ``between`` (the Trainer starts the next step's host-to-device copies
there) -> the engine's global-norm clip -> one world all-reduce carrying the mean loss, the stop
flag and whether the grad norm is finite (:func:`step_flags`), read once on the host
(:func:`agree`) -> the AdamW step, unless the loss or the gradients are not finite on some rank.
The gradients are left to the caller to zero (the Trainer measures the training state first).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..distributed.collectives import all_reduce, group_size, world_group
from ..parallel.engine import StepEngine


@dataclass(frozen=True)
class StepResult:
    """What :func:`run_step` did; identical on every rank."""

    loss: float       # mean training loss over the step's micro-batches and the dp ranks
    grad_norm: float  # global L2 norm of the gradients before clipping; NaN when not finite on some rank
    stop: bool        # some rank asked to stop
    skipped: bool     # the loss or the gradients were not finite: no optimizer step was taken


def step_flags(loss_sum: torch.Tensor, stop: bool, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
    """The step's one world all-reduce, before the host reads it: float64 ``[mean loss over the
    world, ranks asking to stop, ranks with a non-finite grad norm, grad norm]``."""
    device = loss_sum.device
    norm = torch.zeros((), device=device) if grad_norm is None else grad_norm.detach().to(device)
    flag = torch.stack([loss_sum.double(), torch.full((), float(stop), dtype=torch.float64, device=device),
                        (~torch.isfinite(norm)).double()])
    world = world_group()
    all_reduce(flag, world)
    flag[0] /= group_size(world)
    return torch.cat([flag, norm.double().view(1)])


def agree(loss_sum: torch.Tensor, stop: bool, grad_norm: torch.Tensor | None = None
          ) -> tuple[float, bool, bool, float]:
    """One world all-reduce and one host read: the mean of ``loss_sum`` over the world (= over dp;
    TP replicas agree), whether any rank passed ``stop`` and whether ``grad_norm`` is finite on
    every rank. Returns ``(loss, stop, finite, grad_norm)``, identical on all ranks."""
    loss, stops, nonfinite, gnorm = step_flags(loss_sum, stop, grad_norm).tolist()
    return loss, stops > 0, not nonfinite > 0, gnorm


def run_step(engine: StepEngine, optimizer: torch.optim.Optimizer, batches: Sequence, *, grad_clip: float,
             stop: bool = False, timed: bool = False, between: Callable[[], None] | None = None) -> StepResult:
    """One optimizer step over ``batches`` (this rank's micro-batches; module docstring); a
    collective on every rank. ``timed``: the engine times its stages (log steps)."""
    loss_sum = engine.forward_backward(batches, timed=timed)
    if between is not None:
        between()
    grad_norm = engine.clip(grad_clip)
    loss, stop, finite, norm = agree(loss_sum, stop, grad_norm)
    skipped = not (finite and math.isfinite(loss))
    if not skipped:
        optimizer.step()
    return StepResult(loss=loss, grad_norm=norm if finite else float("nan"), stop=stop, skipped=skipped)


__all__ = ["StepResult", "agree", "run_step", "step_flags"]
