"""The planner: which layout and recompute setting fits a model on a cluster, and how fast it runs.

``gpus`` the GPU table; ``layout`` a layout and its checks; ``memory`` bytes per GPU; ``kernels``
and ``timing`` the time model; ``calibrate`` its one calibration (Table 4); ``paper`` the paper's
runs and measurements; ``recompute`` per-layer recompute under a budget; ``search`` enumeration
and ranking; ``report`` and ``cli`` the ``seqpar plan`` command.
"""
from .gpus import GPU, GPUS, custom_gpu, get_gpu
from .layout import Layout, Recompute, check_layout, parse_layout
from .memory import Memory, memory_per_gpu
from .recompute import auto_recompute_layers, best_mix, layer_modes, recompute_layers, resolve_recompute
from .search import PAPER_SPACE, Candidate, Problem, SearchSpace, evaluate, search
from .timing import StepTime, layer_times, step_time

__all__ = [
    "GPU", "GPUS", "custom_gpu", "get_gpu", "Layout", "Recompute", "check_layout", "parse_layout", "Memory",
    "memory_per_gpu", "auto_recompute_layers", "best_mix", "layer_modes", "recompute_layers", "resolve_recompute",
    "PAPER_SPACE", "Candidate", "Problem",
    "SearchSpace", "evaluate", "search", "StepTime", "layer_times", "step_time",
]
