"""Parallelism applied from outside the model: overlapped TP communication, FSDP2 or DDP over ``dp``,
pipeline stages over ``pp``."""
from .compile import compile_blocks, uncompile_blocks
from .data_parallel import DataParallel, state_bytes
from .fsdp import apply_fsdp
from .grads import clip_grad_norm, sum_tied_grads, tied_embedding_group
from ..memory.peak import PeakActivationLedger  # re-exported: the pipeline's users measure with it
from ..memory.schedule import layers_in_flight
from .pipeline import SCHEDULES, PipelineParallel, build_pipeline, resolve_schedule
from .stages import StageModule, build_stage_modules, check_stage_split, local_stage_indices, stage_layers
from .timing import StepTiming, ideal_bubble
from .apply import apply_parallelism, apply_tp_overlap

__all__ = ["compile_blocks", "uncompile_blocks", "DataParallel", "apply_fsdp", "state_bytes", "PipelineParallel", "build_pipeline", "resolve_schedule", "SCHEDULES", "StageModule",
           "build_stage_modules", "check_stage_split", "local_stage_indices", "stage_layers", "clip_grad_norm",
           "sum_tied_grads", "tied_embedding_group", "StepTiming", "ideal_bubble",
           "PeakActivationLedger", "layers_in_flight", "apply_parallelism", "apply_tp_overlap"]
