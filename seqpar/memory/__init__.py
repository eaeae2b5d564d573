"""Activation-memory accounting: the paper's closed-form formulas (``formulas``)."""
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

__all__ = [
    "GIB", "PAPER_MODELS", "SELECTIVE_DROPPED", "TECHNIQUES", "ModelShape", "Technique",
    "activation_breakdown", "attention_score_share", "bytes_per_layer", "extra_bytes",
    "first_stage_bytes", "gib", "interleave_factor", "load_shape", "paper_config_dir",
    "paper_shapes", "per_gpu_bytes", "ratio_to_tp",
]
