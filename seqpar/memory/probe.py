"""The activation bytes a training run keeps for backward: measured once, next to the formula.

On CPU the :class:`~seqpar.memory.ledger.ActivationLedger` counts what autograd saves during the
first micro-batch's forward; on CUDA it is the growth of ``torch.cuda.memory_allocated`` across
that forward. The formula is :func:`seqpar.memory.whole_model.model_activation_bytes` for the
run's model, TP size, micro-batch and precision (Table 2 per layer plus the §4.3 extras).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from .ledger import ActivationLedger
from .whole_model import model_activation_bytes
from ..model.config import GPTConfig


class ActivationProbe:
    """Measures the first forward it is given (:meth:`measure`), then nothing."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.measured: int | None = None

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Wrap one forward pass; only the first call measures."""
        if self.measured is not None:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before = torch.cuda.memory_allocated(self.device)
            yield
            torch.cuda.synchronize(self.device)
            self.measured = torch.cuda.memory_allocated(self.device) - before
            return
        with ActivationLedger(self.model) as ledger:
            yield
        self.measured = ledger.total()

    def line(self, cfg: GPTConfig, *, t: int, micro_batch: int, activation_bytes: int) -> str:
        """``activations: X MiB saved per rank, formula Y MiB (ratio R)``."""
        formula = model_activation_bytes(cfg, t=t, micro_batch=micro_batch, activation_bytes=activation_bytes)["total"]
        x = self.measured or 0
        return (f"activations: {x / 2**20:.2f} MiB saved per rank, formula {formula / 2**20:.2f} MiB "
                f"(ratio {x / formula:.3f})")


__all__ = ["ActivationProbe"]
