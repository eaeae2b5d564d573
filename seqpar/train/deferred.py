"""What a training step leaves on the device until the Trainer reads it.

Under fused AdamW a step decides its non-finite skip on the device (:mod:`seqpar.train.step`), so
a step that logs nothing reads nothing: its loss, grad norm and skip flag stay in its
:class:`~seqpar.train.step.StepResult` until the next *reading* step (a logging, evaluation,
checkpoint or last step, :func:`reads_at`), which reads every step since in one host read.
The one value needed sooner is the stop flag (SIGTERM / Ctrl-C on some rank): each unread step's
flag is copied to host memory without blocking (:class:`StopMailbox`) and looked at one step later,
after that step's work is queued, so waiting for it never empties the device's queue.
"""
from __future__ import annotations

import torch

from ..config import RunConfig
from .step import StepResult


class StepMetrics:
    """What one optimizer step reports; identical on every rank. ``loss``, ``grad_norm`` and
    ``skipped`` are read from the device when first asked for, unless the step was already read."""

    def __init__(self, lr: float, result: StepResult, stop: bool):
        self.lr = lr          # learning rate the step used
        self.stop = stop      # some rank asked to stop (SIGTERM): checkpoint and exit after this step
        self.result = result

    @property
    def resolved(self) -> bool:
        """The step's values are on the host."""
        return self.result.resolved

    @property
    def loss(self) -> float:
        """Mean training loss over the step's micro-batches and the dp ranks."""
        return self.result.loss

    @property
    def grad_norm(self) -> float:
        """Global L2 norm of the full model's gradients, before clipping (NaN when not finite)."""
        return self.result.grad_norm

    @property
    def skipped(self) -> bool:
        """Non-finite loss or gradients under ``train.nonfinite_grads=skip``: no optimizer step."""
        return self.result.skipped

    def _key(self) -> tuple:
        return (self.lr, self.stop, self.loss, self.grad_norm, self.skipped)

    def __eq__(self, other: object) -> bool:
        """Equal values (reads both steps' flags)."""
        return isinstance(other, StepMetrics) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # the values are read lazily: not a dict key

    def __repr__(self) -> str:
        values = f"loss={self.loss}, grad_norm={self.grad_norm}, skipped={self.skipped}" if self.resolved else "unread"
        return f"StepMetrics(lr={self.lr}, stop={self.stop}, {values})"


def reads_at(cfg: RunConfig, done: int) -> bool:
    """Whether the step ending at ``done`` (from 1) reads its flags: it logs, evaluates, checkpoints
    or is the last step."""
    tc, interval = cfg.train, cfg.checkpoint.interval
    return (done % tc.log_interval == 0 or done == tc.steps or (interval > 0 and done % interval == 0)
            or (tc.eval_interval > 0 and done % tc.eval_interval == 0))


class StopMailbox:
    """The stop flag of the previous unread step: :meth:`post` queues its copy to (pinned) host
    memory behind the step's all-reduce, :meth:`take` waits for that copy alone (a CUDA event), not
    for the work queued after it, and reads it. Every rank reads the same all-reduced flag."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.host = torch.zeros(1, dtype=torch.float64, pin_memory=self.cuda)
        self.view = self.host.numpy()  # the host buffer, read after the copy is done
        self.event = None
        self.posted = False

    def post(self, result: StepResult) -> None:
        """Queue the copy of ``result``'s stop flag (a step that was not read)."""
        self.host.copy_(result.flags[1:2], non_blocking=self.cuda)
        if self.cuda:
            self.event = torch.cuda.Event()
            self.event.record()
        self.posted = True

    def take(self) -> bool:
        """Whether the posted step's flag says stop (False when nothing was posted)."""
        if not self.posted:
            return False
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        self.posted = False
        return bool(self.view[0] > 0)


__all__ = ["StepMetrics", "StopMailbox", "reads_at"]
