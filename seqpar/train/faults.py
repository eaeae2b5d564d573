"""What the Trainer does when something goes wrong: SIGTERM / SIGINT, non-finite values.

Every decision that involves several ranks is taken on a value all ranks agree on (the
Trainer's one all-reduce per step, or the all-reduce in :func:`check_finite_weights`), so every
rank stops, skips or saves together and none enters a collective alone.
"""
from __future__ import annotations

import math
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from ..sharding import local_tensor


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


def nonfinite_error(step: int, loss: float, grad_norm: float) -> FloatingPointError:
    """The error that stops the run at optimizer step ``step`` (from 0); the weights are untouched."""
    return FloatingPointError(f"{nonfinite_what(loss, grad_norm)} at step {step + 1}; stopping before the "
                              f"optimizer step. Lower train.lr or check the data, or set "
                              f"train.nonfinite_grads=skip; the last checkpoint is kept.")


def check_finite_weights(model: nn.Module, step: int) -> None:
    """Raise ``FloatingPointError`` on every rank when any rank's weights hold NaN/inf, naming this
    rank's offending parameters. One all-reduce over the world; call on every rank before saving."""
    params = [(n, local_tensor(p.detach())) for n, p in model.named_parameters()]  # FSDP: this rank's shard
    device = params[0][1].device if params else torch.device("cpu")  # the mesh's device (CUDA: NCCL)
    finite = torch.stack([torch.isfinite(p).all() for _, p in params]) if params else torch.ones(0, device=device)
    count = (~finite.bool()).sum(dtype=torch.float64).view(1)  # built on the device: no host copy
    if dist.is_initialized():
        dist.all_reduce(count)
    total, *oks = torch.cat([count, finite.double()]).tolist()  # one host read
    bad = [n for (n, _), ok in zip(params, oks) if not ok]
    if total > 0:
        where = "on another rank"
        if bad:
            where = "here: " + ", ".join(bad[:8]) + (" ..." if len(bad) > 8 else "")
        raise FloatingPointError(f"refusing to checkpoint step {step}: the weights hold NaN/inf ({where}); "
                                 f"the last checkpoint is kept")
