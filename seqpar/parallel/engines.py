"""The step engine of a run: pipeline stages when ``pp > 1``, else the GPT over ddp / fsdp."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from ..config import RunConfig
from ..distributed.mesh import ParallelMesh
from .engine import ActivationProbe, PrecisionRecipe, StepEngine
from .pipeline_engine import PipelineEngine
from .plain_engine import PlainEngine


def build_engine(cfg: RunConfig, mesh: ParallelMesh, *, accum: int, precision: PrecisionRecipe,
                 probe: Callable[[nn.Module, torch.device], ActivationProbe] | None = None) -> StepEngine:
    """The engine of a resolved ``cfg`` on ``mesh``: pipeline stages when ``mesh.pp_size > 1``,
    else the GPT over ddp / fsdp. ``probe(model, device)`` builds the activation probe."""
    if mesh.pp_size > 1:
        return PipelineEngine(cfg, mesh, accum=accum, precision=precision)
    return PlainEngine(cfg, mesh, accum=accum, precision=precision, probe=probe)


__all__ = ["build_engine"]
