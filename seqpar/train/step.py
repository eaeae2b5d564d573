"""One optimizer step: the Trainer's, and the one the tools run when they observe it (``seqpar.tools``).

:func:`run_step`, on every rank: the engine's forward/backward over the step's micro-batches
(:mod:`seqpar.parallel.engine` describes what happens inside it: micro-batches, precision,
reductions over dp and TP) -> ``between`` (the Trainer starts the next step's host-to-device copies
there) -> the engine's global-norm clip -> one world all-reduce carrying the mean loss, the stop
flag and whether the grad norm is finite (:func:`step_flags`) -> the AdamW step, not taken when the
loss or the gradients are not finite on some rank. How that skip is decided:

* fused AdamW (the default on CUDA): on the device. The flags give AdamW's ``found_inf`` (1.0 skips
  the whole update and its step count), so the step reads nothing on the host; the
  :class:`StepResult` keeps the flags until someone reads them (the Trainer: once, at its next
  logging step, :func:`read_results`).
* foreach AdamW (the default on the CPU, where a host read drains no device queue): the flags are
  read on the host at once (:func:`agree`) and ``optimizer.step()`` is not called.

The gradients are left to the caller to zero (the Trainer measures the training state first).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from ..distributed.collectives import all_reduce, group_size, world_group
from ..parallel.engine import StepEngine

Values = tuple[float, bool, bool, float]  # (loss, stop, skipped, grad_norm), as StepResult reports them


class StepResult:
    """What :func:`run_step` did; identical on every rank. Its values are read from the step's
    device flags the first time one is asked for (one host read), unless already read."""

    def __init__(self, flags: torch.Tensor | None, values: Values | None = None):
        self.flags = flags      # float64 [mean loss, stops, non-finite ranks, grad norm], on the device
        self._values = values

    @property
    def resolved(self) -> bool:
        """The values are on the host (reading them costs nothing more)."""
        return self._values is not None

    def fill(self, row: Sequence[float]) -> None:
        """Set the values from the host copy ``row`` of :attr:`flags`."""
        loss, stops, nonfinite, norm = row
        finite = not nonfinite > 0
        self._values = (loss, stops > 0, not (finite and math.isfinite(loss)), norm if finite else float("nan"))

    def _get(self) -> Values:
        if self._values is None:
            read_results([self])
        return self._values

    @property
    def loss(self) -> float:
        """Mean training loss over the step's micro-batches and the dp ranks."""
        return self._get()[0]

    @property
    def stop(self) -> bool:
        """Some rank asked to stop."""
        return self._get()[1]

    @property
    def skipped(self) -> bool:
        """The loss or the gradients were not finite: no optimizer step was taken."""
        return self._get()[2]

    @property
    def grad_norm(self) -> float:
        """Global L2 norm of the gradients before clipping; NaN when not finite on some rank."""
        return self._get()[3]


def read_results(results: Sequence[StepResult]) -> None:
    """Read the flags of every unread result in ``results`` with one host read."""
    todo = [r for r in results if not r.resolved]
    if todo:
        for result, row in zip(todo, torch.stack([r.flags for r in todo]).tolist()):
            result.fill(row)


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


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a non-finite step from a device flag (fused AdamW's ``found_inf``)."""
    return bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)


class Halt:
    """``train.nonfinite_grads=stop`` on the device: once a step is not finite, no later step updates
    the weights (the flag stays 1.0), so when the Trainer reads the flags and stops, naming that
    step, the weights are those from before it."""

    def __init__(self):
        self.flag: torch.Tensor | None = None

    def __call__(self, found: torch.Tensor) -> torch.Tensor:
        self.flag = found if self.flag is None else torch.maximum(self.flag, found)
        return self.flag


def _optimizer_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """AdamW's step with ``found_inf`` (a float32 0-dim device tensor, 1.0: skip) as
    ``torch.amp.GradScaler`` passes it to fused optimizers."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def run_step(engine: StepEngine, optimizer: torch.optim.Optimizer, batches: Sequence, *, grad_clip: float,
             stop: bool = False, timed: bool = False, between: Callable[[], None] | None = None,
             halt: Halt | None = None) -> StepResult:
    """One optimizer step over ``batches`` (this rank's micro-batches; module docstring); a
    collective on every rank. ``timed``: the engine times its stages (log steps). ``halt``: keep
    skipping after a non-finite step (device skips only; ``train.nonfinite_grads=stop``)."""
    loss_sum = engine.forward_backward(batches, timed=timed)
    if between is not None:
        between()
    grad_norm = engine.clip(grad_clip)
    if not skips_on_device(optimizer):
        loss, stop, finite, norm = agree(loss_sum, stop, grad_norm)
        result = StepResult(None)
        result.fill((loss, float(stop), float(not finite), norm))
        if not result.skipped:
            optimizer.step()
        return result
    flags = step_flags(loss_sum, stop, grad_norm)
    found = ((flags[2] > 0) | ~torch.isfinite(flags[0])).float()  # 1.0: skip the update
    _optimizer_step(optimizer, halt(found) if halt is not None else found)
    return StepResult(flags)


__all__ = ["Halt", "StepResult", "agree", "read_results", "run_step", "skips_on_device", "step_flags"]
