"""The recipe: parallelism applied to this rank's model parts, in one order, stated here once.

:func:`apply_parallelism` takes the parts a rank trains -- the whole GPT, or its pipeline stages
(``pp > 1``, cut from outside by :mod:`seqpar.parallel.stages`) -- and applies, to each part:

1. **TP + SP**: the column/row-parallel layers split their weights over the mesh's ``tp`` group
   and, with ``model.sequence_parallel``, shard norms/dropout/residual along the sequence. They
   are built that way (a layer's layout is its parameters' shape), so this step checks that every
   part was built on this mesh.
2. **CP**: attention exchanges K/V over the mesh's ``cp`` group (built in, checked likewise).
   **EP**: each MoE layer's experts split over the mesh's ``ep`` group, carved from dp
   (:func:`~seqpar.distributed.mesh.expert_parallel`); built in, checked likewise. Their gradients
   are reduced over the expert-data-parallel group in step 6 (:mod:`seqpar.parallel.expert_grads`).
3. **Recompute**: the run's modes (``none`` / ``selective`` / ``full``, uniform or one per layer)
   set on each part's blocks -- a transform of the part, nothing written back into a config.
4. **Overlap** (``parallel.tp_overlap``): SP's all-gather / reduce-scatter in per-rank chunks under
   the GEMMs.
5. **Compile** (``train.compile``): each block compiled on its own under its recompute policy.
6. **Data parallelism**: FSDP2 or DDP over ``dp`` (x ``cp``) for the whole GPT; pipeline stages
   reduce their gradients over ``dp`` inside the pipeline step instead.

A new parallel dimension (expert parallelism) is a new step here plus its layers. The order
matters: compile must see the recompute policy and the overlapped layers, and FSDP2's hooks must
stay outside the compiled graphs, so data parallelism comes last.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.nn as nn

from ..config import RunConfig
from ..distributed.mesh import ParallelMesh
from ..layers import ColumnParallelLinear, RowParallelLinear
from .compile import CompileReport, compile_blocks, compile_enabled, merge_reports
from .data_parallel import DataParallel

RECIPE = ("tp/sp", "cp", "ep", "recompute", "overlap", "compile", "data parallel")  # the order, once


@dataclass
class Applied:
    """What :func:`apply_parallelism` did to a rank's parts."""

    parts: list[nn.Module]
    steps: list[str] = field(default_factory=list)  # the recipe's steps taken, in order
    compiled: CompileReport | None = None            # train.compile's blocks
    data_parallel: DataParallel | None = None        # the GPT over FSDP2 / DDP (no pipeline stages)


def check_built_for(part: nn.Module, mesh: ParallelMesh) -> None:
    """Steps 1 and 2: ``part`` (a GPT or a stage) was built with ``mesh``'s TP, CP and EP sizes."""
    cp = getattr(getattr(part, "cp", None), "size", 1)
    ep = getattr(getattr(part, "mesh", None), "ep_size", 1)
    if part.tp_size != mesh.tp_size or cp != mesh.cp_size or ep != mesh.ep_size:
        eps = (f" ep={ep}", f" ep={mesh.ep_size}") if ep != mesh.ep_size else ("", "")
        raise ValueError(f"{type(part).__name__} was built for tp={part.tp_size} cp={cp}{eps[0]}, the mesh has "
                         f"tp={mesh.tp_size} cp={mesh.cp_size}{eps[1]}")


def apply_recompute(part: nn.Module, model_cfg) -> None:
    """Step 3: the run's recompute on ``part``'s layers: ``model.recompute_layers`` (this part's
    slice of them) when set, else ``model.recompute`` with its method and layer count."""
    if model_cfg.recompute_layers is not None:
        ids = getattr(part, "layer_ids", range(len(part.blocks)))
        part.set_recompute([model_cfg.recompute_layers[i] for i in ids])
    else:
        part.set_recompute(model_cfg.recompute, model_cfg.recompute_method, model_cfg.recompute_num_layers)


def apply_tp_overlap(model: nn.Module, enabled: bool = True) -> int:
    """Step 4: set ``tp_overlap`` to ``enabled`` on ``model``'s sequence-parallel TP layers (``t > 1``);
    return how many layers it set. Changes no parameter, result or saved tensor."""
    layers = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
              and m.sequence_parallel and m.tp_size > 1]
    for m in layers:
        m.tp_overlap = enabled
    return len(layers)


def _blocks(part: nn.Module) -> list[nn.Module]:
    blocks = part.blocks
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def apply_parallelism(parts: Sequence[nn.Module], cfg: RunConfig, mesh: ParallelMesh, *, precision=None,
                      data_parallel: bool = True) -> Applied:
    """Apply the recipe (module docstring) to ``parts``, in place, for the resolved ``cfg``.
    ``data_parallel``: wrap the single part (the whole GPT) for FSDP2 / DDP with ``precision``
    (a :class:`~seqpar.parallel.precision.Precision`); False for pipeline stages."""
    pc, mc = cfg.parallel, cfg.model
    out = Applied(list(parts))
    for part in out.parts:
        check_built_for(part, mesh)
    out.steps += ["tp/sp", "cp", "ep"]
    for part in out.parts:
        apply_recompute(part, mc)
    out.steps.append("recompute")
    for part in out.parts:
        apply_tp_overlap(part, pc.tp_overlap)
    out.steps.append("overlap")
    if compile_enabled(cfg.train.compile, mesh.device, mc, mesh.cp_size):
        out.compiled = merge_reports([compile_blocks(part, _blocks(part)) for part in out.parts])
        out.steps.append("compile")
    if data_parallel:
        if len(out.parts) != 1:
            raise ValueError(f"data parallelism wraps one model, got {len(out.parts)} parts")
        out.data_parallel = DataParallel(out.parts[0], mesh, pc.data_parallel_mode(mesh.dp_size),
                                         precision=precision.name, master_weights=precision.master_weights,
                                         reshard_after_forward=pc.reshard_after_forward, bucket_mib=pc.bucket_mib)
        out.steps.append("data parallel")
    return out


__all__ = ["Applied", "RECIPE", "apply_parallelism", "apply_recompute", "apply_tp_overlap", "check_built_for"]
