"""Training: data pipeline, the Trainer (setup, train_step, evaluate, save/resume, fit), checkpoints.

The Trainer's names are loaded on first use, so ``seqpar train --nproc-per-node N`` (the launcher,
:mod:`seqpar.train.launch`) starts its ranks without importing the training stack it never runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trainer import StepMetrics, Trainer, train

__all__ = ["StepMetrics", "Trainer", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'seqpar.train' has no attribute {name!r}")
