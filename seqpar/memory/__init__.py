"""Activation-memory accounting: the paper's closed-form formulas (``formulas``) and a ledger
that measures what a forward pass keeps (``ledger``)."""
from .formulas import (
    GIB,
    PAPER_MODELS,
    SELECTIVE_DROPPED,
    TECHNIQUES,
    ModelShape,
    Technique,
    activation_breakdown,
    attention_score_share,
    bytes_per_layer,
    extra_bytes,
    first_stage_bytes,
    gib,
    interleave_factor,
    load_shape,
    paper_config_dir,
    paper_shapes,
    per_gpu_bytes,
    ratio_to_tp,
)
from .ledger import ActivationLedger, SavedTensor

__all__ = [
    "ActivationLedger", "SavedTensor",
    "GIB", "PAPER_MODELS", "SELECTIVE_DROPPED", "TECHNIQUES", "ModelShape", "Technique",
    "activation_breakdown", "attention_score_share", "bytes_per_layer", "extra_bytes",
    "first_stage_bytes", "gib", "interleave_factor", "load_shape", "paper_config_dir",
    "paper_shapes", "per_gpu_bytes", "ratio_to_tp",
]
