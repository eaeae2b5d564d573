"""Training: data pipeline, the Trainer (setup, train_step, evaluate, save/resume, fit), checkpoints."""
from .trainer import StepMetrics, Trainer, train

__all__ = ["StepMetrics", "Trainer", "train"]
