"""The run's named modes, spelled once: what a layer recomputes (and how full
recompute groups layers), which attention kernel runs, how dp shares state, the precision.

Each is a ``Literal`` type for the typed configs and a tuple of its values for checks and loops;
everything above ``model`` imports them from here (the recompute modes are defined in
:mod:`seqpar.recompute`, which sits below ``model`` and checks them too).
"""
from __future__ import annotations

from typing import Literal, get_args

import torch

# defined with the recompute plans, below model
from ..recompute import RECOMPUTE_METHODS, RECOMPUTE_MODES, RecomputeMethod, RecomputeMode
from .recompute_ops import RECOMPUTE_OPS, RecomputeOp

# seqpar's own attention core (Table 2's bytes), PyTorch's fused kernels, or auto: sdpa on CUDA, math elsewhere
AttentionMode = Literal["auto", "math", "sdpa"]
ATTENTION_MODES: tuple[AttentionMode, ...] = get_args(AttentionMode)
AttentionKernel = Literal["math", "sdpa"]  # a resolved model.attention


def resolve_attention(setting: str, device: str | torch.device) -> AttentionKernel:
    """``model.attention`` as it runs on ``device``: ``auto`` is ``sdpa`` on CUDA (flash, cuDNN or
    memory-efficient kernels) and ``math`` elsewhere, where seqpar's own core reproduces the paper's
    Table 2 (the CPU, where the memory checks measure); ``math`` and ``sdpa`` are kept as given."""
    if setting not in ATTENTION_MODES:
        raise ValueError(f"model.attention must be one of {ATTENTION_MODES}, got {setting!r}")
    if setting != "auto":
        return setting  # type: ignore[return-value]
    return "sdpa" if torch.device(device).type == "cuda" else "math"

DataParallelMode = Literal["ddp", "fsdp"]  # replicated state + all-reduce, or FSDP2 shards over dp
DATA_PARALLEL_MODES: tuple[DataParallelMode, ...] = get_args(DataParallelMode)

Precision = Literal["fp32", "bf16", "bf16-autocast"]  # a resolved train.precision
PRECISIONS: tuple[Precision, ...] = get_args(Precision)
PrecisionSetting = Literal["auto", Precision]         # train.precision: auto = bf16 on CUDA, fp32 on CPU
PRECISION_SETTINGS: tuple[str, ...] = get_args(PrecisionSetting)

__all__ = ["ATTENTION_MODES", "DATA_PARALLEL_MODES", "PRECISIONS", "PRECISION_SETTINGS", "RECOMPUTE_METHODS",
           "RECOMPUTE_MODES", "AttentionKernel", "AttentionMode", "DataParallelMode", "Precision", "PrecisionSetting",
           "RECOMPUTE_OPS", "RecomputeMethod", "RecomputeMode", "RecomputeOp", "resolve_attention"]
