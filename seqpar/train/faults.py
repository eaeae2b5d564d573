"""What the Trainer does when something goes wrong: SIGTERM / SIGINT, non-finite values.

Every decision that involves several ranks is taken on a value all ranks agree on (the
Trainer's one all-reduce per step, or the all-reduce in :func:`check_finite_weights`), so every
rank stops, skips or saves together and none enters a collective alone. A run that cannot go on
from NaN/inf (:class:`NonFiniteError`) ends like bad input: one line, exit code 2.
"""
from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch
import torch.nn as nn

from ..distributed.collectives import all_reduce, world_group
from ..errors import UserError
from ..sharding import local_tensor


class NonFiniteError(UserError, FloatingPointError):
    """Training (or sampling) met NaN/inf it cannot go on from: a non-finite step under
    ``train.nonfinite_grads=stop``, more skipped steps in a row than ``train.max_skipped_steps``,
    weights holding NaN/inf at a save, logits holding NaN/inf. Printed as one line, exit code 2."""


class StopRequest:
    """Remembers a SIGTERM or SIGINT (Ctrl-C) so the loop can checkpoint and exit at the next step
    boundary. A second SIGINT more than a second after the first raises ``KeyboardInterrupt`` (abort,
    no checkpoint); closer ones count once, as when torchrun forwards the Ctrl-C the terminal already
    delivered to every rank."""

    def __init__(self):
        self.requested = False
        self.name: str | None = None  # the first signal this rank received
        self._first = 0.0
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        now = time.monotonic()
        if signum == signal.SIGINT and self.name == "SIGINT" and now - self._first > 1.0:
            raise KeyboardInterrupt
        if not self.requested:
            self.requested, self.name, self._first = True, signal.Signals(signum).name, now
        elif signum == signal.SIGINT and self.name != "SIGINT":
            self.name, self._first = "SIGINT", now  # the first Ctrl-C after a SIGTERM: the next one aborts

    def restore(self) -> None:
        """Put back the handlers that were installed before."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def nonfinite_what(loss: float, grad_norm: float) -> str:
    """What was not finite: the loss (named first: it implies the gradients) or the gradients."""
    if math.isfinite(loss):
        return f"non-finite gradients (global grad norm {grad_norm})"
    return f"non-finite loss ({loss})"


def _kept(checkpoint: Path | None) -> str:
    return f"the last checkpoint, {checkpoint}, is kept" if checkpoint else "no checkpoint was written"


def nonfinite_error(step: int, loss: float, grad_norm: float, checkpoint: Path | None = None) -> NonFiniteError:
    """The error that stops the run at optimizer step ``step`` (from 0); the weights are untouched.
    ``checkpoint``: the last one written (or resumed from)."""
    return NonFiniteError(f"{nonfinite_what(loss, grad_norm)} at step {step + 1}; stopping before the "
                          f"optimizer step. Lower train.lr or check the data, or set "
                          f"train.nonfinite_grads=skip; {_kept(checkpoint)}.")


def steps_named(first: int, last: int) -> str:
    """``"step 7"`` or ``"steps 13-23"``."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


class SkippedSteps:
    """The steps ``train.nonfinite_grads=skip`` dropped, as the loop needs them: the current run of
    consecutive ones (more than ``limit`` stops the run) and whether one fell since the last
    checkpoint (a checkpoint after such an interval may hold weights already going bad, so it does
    not become the one to roll back to). Identical on every rank: fed from the step's agreed flags."""

    def __init__(self, limit: int):
        self.limit = limit             # train.max_skipped_steps
        self.streak: list[int] = []    # consecutive skipped steps (from 1), the newest last
        self.since_checkpoint = False  # a step was skipped since the last checkpoint (or the resume)

    def skip(self, step: int, what: str, good: Path | None) -> None:
        """Count skipped step ``step`` (from 1); past the limit raise :class:`NonFiniteError` naming
        the streak and ``good``, the checkpoint to roll back to."""
        self.streak.append(step)
        self.since_checkpoint = True
        if len(self.streak) > self.limit:
            back = (f"roll back to the last good checkpoint with checkpoint.resume={good} and a lower train.lr"
                    if good else "no good checkpoint was written; start again with a lower train.lr")
            raise NonFiniteError(f"{steps_named(self.streak[0], step)} skipped in a row, more than "
                                 f"train.max_skipped_steps={self.limit} (step {step}: {what}): the run has "
                                 f"diverged; {back}")

    def take(self) -> None:
        """A step whose optimizer step was taken: the streak ends."""
        self.streak = []

    def checkpointed(self) -> bool:
        """A checkpoint is being written: whether no step was skipped since the previous one."""
        clean, self.since_checkpoint = not self.since_checkpoint, False
        return clean


def check_finite_weights(model: nn.Module, step: int) -> None:
    """Raise :class:`NonFiniteError` on every rank when any rank's weights hold NaN/inf, naming this
    rank's offending parameters. One all-reduce over the world; call on every rank before saving."""
    params = [(n, local_tensor(p.detach())) for n, p in model.named_parameters()]  # FSDP: this rank's shard
    device = params[0][1].device if params else torch.device("cpu")  # the mesh's device (CUDA: NCCL)
    finite = torch.stack([torch.isfinite(p).all() for _, p in params]) if params else torch.ones(0, device=device)
    count = (~finite.bool()).sum(dtype=torch.float64).view(1)  # built on the device: no host copy
    all_reduce(count, world_group())
    total, *oks = torch.cat([count, finite.double()]).tolist()  # one host read
    bad = [n for (n, _), ok in zip(params, oks) if not ok]
    if total > 0:
        where = "on another rank"
        if bad:
            where = "here: " + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise NonFiniteError(f"refusing to checkpoint step {step}: the weights hold NaN/inf ({where}); "
                             f"the last checkpoint is kept")
