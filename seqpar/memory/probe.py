"""The activation bytes a training run keeps for backward: measured once, next to the formula.

On CPU the :class:`~seqpar.memory.ledger.ActivationLedger` counts what autograd saves during the
first micro-batch's forward; on CUDA it is the growth of ``torch.cuda.memory_allocated`` across
that forward less the parameter storages that forward left behind (:func:`new_weight_bytes`):
under FSDP2 the root unit keeps its all-gathered parameters from its forward to its backward, and
they are weights, not activations. The formula is :func:`seqpar.memory.whole_model.model_activation_bytes` for the
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


def weight_storages(model: nn.Module) -> dict[int, int]:
    """``{storage address: bytes}`` of the parameters ``model`` holds now (a DTensor's local shard)."""
    out = {}
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        out[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return out


def new_weight_bytes(model: nn.Module, before: dict[int, int]) -> int:
    """Bytes of parameter storages ``model`` holds now that it did not hold at ``before``
    (:func:`weight_storages`): e.g. FSDP2's gathered root after its forward."""
    return sum(n for ptr, n in weight_storages(model).items() if ptr not in before)


class ActivationProbe:
    """Measures the first forward it is given (:meth:`measure`), then nothing."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.model, self.device = model, device
        self.measured: int | None = None
        self.in_layers: int | None = None  # of it, inside the transformer layers (CPU: the ledger's)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        """Wrap one forward pass; only the first call measures."""
        if self.measured is not None:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            before, weights = torch.cuda.memory_allocated(self.device), weight_storages(self.model)
            yield
            torch.cuda.synchronize(self.device)
            grown = torch.cuda.memory_allocated(self.device) - before
            self.measured = grown - new_weight_bytes(self.model, weights)
            return
        with ActivationLedger(self.model) as ledger:
            yield
        self.measured, self.in_layers = ledger.total(), sum(ledger.per_layer().values())

    def line(self, cfg: GPTConfig, *, t: int, micro_batch: int, activation_bytes: int, cp: int = 1) -> str:
        """``activations: X MiB saved per rank, formula Y MiB (ratio R)``."""
        formula = model_activation_bytes(cfg, t=t, micro_batch=micro_batch, activation_bytes=activation_bytes,
                                         device=self.device.type, cp=cp)["total"]
        x = self.measured or 0
        return (f"activations: {x / 2**20:.2f} MiB saved per rank, formula {formula / 2**20:.2f} MiB "
                f"(ratio {x / formula:.3f})")


__all__ = ["ActivationProbe", "new_weight_bytes", "weight_storages"]
