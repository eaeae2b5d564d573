"""Busy time of a pipeline rank's stages, and the bubble it leaves (idle time per step).

A rank is busy while one of its stages computes a forward or backward chunk (the TP
collectives inside included); everything else in a schedule step is waiting on neighbours
(point-to-point transfers, the warm-up and cool-down bubble). For ``p`` stages, ``m`` virtual
stages per rank and ``n`` micro-batches the schedules' ideal bubble is ``(p-1)/(m n)`` of the
busy time (Narayanan et al. 2021): :func:`ideal_bubble`.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Iterator

import torch


def ideal_bubble(pp: int, virtual_stages: int, n_microbatches: int) -> float:
    """``(p - 1) / (m * n)``: bubble time over ideal compute time of 1F1B / interleaved 1F1B."""
    return (pp - 1) / (virtual_stages * n_microbatches)


@dataclass
class StepTiming:
    """One schedule step on one rank: wall seconds, seconds spent computing chunks."""

    step_s: float
    busy_s: float

    @property
    def idle_fraction(self) -> float:
        """Idle share of the step's wall time."""
        return max(0.0, 1.0 - self.busy_s / self.step_s) if self.step_s > 0 else 0.0

    @property
    def bubble(self) -> float:
        """Idle time over busy time: the quantity :func:`ideal_bubble` predicts."""
        return max(0.0, self.step_s - self.busy_s) / self.busy_s if self.busy_s > 0 else 0.0


class StageTimer:
    """Accumulates busy seconds of the stages that report to it; :meth:`step` times a whole step."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.last: StepTiming | None = None
        self.sync_cuda = False  # set per step: synchronize after each CUDA chunk (exact busy time)

    @contextmanager
    def busy(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start

    @contextmanager
    def step(self, record: bool = True) -> Iterator[None]:
        """Time one schedule step; ``record=False`` keeps :attr:`last` (a CUDA step run without
        synchronizing measures kernel launches, not kernels)."""
        self.busy_s, start = 0.0, time.perf_counter()
        try:
            yield
        finally:
            if record:
                self.last = StepTiming(time.perf_counter() - start, self.busy_s)


@cache
def timed_stage_class() -> type:
    """``TimedStage``, a ``PipelineStage`` that reports the time of each forward and backward chunk to
    ``timer``; built on first use, since ``torch.distributed.pipelining`` loads dynamo, which a run
    without pipeline stages never needs."""
    from torch.distributed.pipelining import PipelineStage

    class TimedStage(PipelineStage):
        """A ``PipelineStage`` that reports the time of each forward and backward chunk to ``timer``.
        On CUDA a chunk ends with a device synchronize while ``timer.sync_cuda`` is set (a timed
        step), so the time is the kernels' and not only their launch; the other steps run unsynchronized."""

        def __init__(self, *args, timer: StageTimer, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.timer = timer
            self._cuda = torch.device(self.device).type == "cuda"

        @property
        def _sync(self) -> bool:
            return self._cuda and self.timer.sync_cuda

        def forward_one_chunk(self, *args, **kwargs):
            with self.timer.busy():
                out = super().forward_one_chunk(*args, **kwargs)
                if self._sync:
                    torch.cuda.synchronize(self.device)
                return out

        def backward_one_chunk(self, *args, **kwargs):
            with self.timer.busy():
                out = super().backward_one_chunk(*args, **kwargs)
                if self._sync:
                    torch.cuda.synchronize(self.device)
                return out

    return TimedStage


