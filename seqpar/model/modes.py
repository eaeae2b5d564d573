"""The run's named modes, spelled once: what a layer recomputes (and how full
recompute groups layers), which attention kernel runs, how dp shares state, the precision.

Each is a ``Literal`` type for the typed configs and a tuple of its values for checks and loops;
everything above ``model`` imports them from here (the recompute modes are defined in
:mod:`seqpar.recompute`, which sits below ``model`` and checks them too).
"""
from __future__ import annotations

from typing import Literal, get_args

# defined with the recompute plans, below model
from ..recompute import RECOMPUTE_METHODS, RECOMPUTE_MODES, RecomputeMethod, RecomputeMode

AttentionMode = Literal["math", "sdpa"]  # seqpar's own attention core, or PyTorch's fused kernels
ATTENTION_MODES: tuple[AttentionMode, ...] = get_args(AttentionMode)

DataParallelMode = Literal["ddp", "fsdp"]  # replicated state + all-reduce, or FSDP2 shards over dp
DATA_PARALLEL_MODES: tuple[DataParallelMode, ...] = get_args(DataParallelMode)

Precision = Literal["fp32", "bf16", "bf16-autocast"]  # a resolved train.precision
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
PrecisionSetting = Literal["auto", Precision]         # train.precision: auto = bf16 on CUDA, fp32 on CPU
PRECISION_SETTINGS: tuple[str, ...] = get_args(PrecisionSetting)

__all__ = ["ATTENTION_MODES", "DATA_PARALLEL_MODES", "PRECISIONS", "PRECISION_SETTINGS", "RECOMPUTE_METHODS",
           "RECOMPUTE_MODES", "AttentionMode", "DataParallelMode", "Precision", "PrecisionSetting", "RecomputeMethod",
           "RecomputeMode"]
