"""Memory pre-flight: a run whose predicted peak per rank exceeds its device's memory is refused
before anything is built, instead of running until the allocator fails.

The prediction is the planner's, term by term (:func:`seqpar.plan.memory.stage_memory` of every
pipeline stage, the busiest one taken: training state, activations in and outside the layers, the
backward transient, the allowance), the figures ``seqpar plan`` and ``seqpar train --dry-run``
print; this module has no byte formula of its own. The device's memory: a CUDA device's total; on
the CPU the host's RAM (``MemTotal``) shared by the ranks on this host, with no CUDA workspace in
the allowance. Only a run predicted above that is refused, so a run the formulas overestimate
still fits unless it is far out; ``train.memory_check: false`` skips the check (memory the system
adds beyond what it reports, a device the formulas do not describe).
"""
from __future__ import annotations

import os

import torch

from ..errors import UserError
from ..plan.gpus import GIB
from ..plan.layout import run_layout
from ..plan.memory import WORKSPACE_BYTES, Memory, stage_memory
from ..plan.recompute import planner_precision, stage_layer_ids
from .resolve import ResolvedRun


def host_memory_bytes() -> int | None:
    """The host's RAM in bytes (``MemTotal`` of ``/proc/meminfo``, else ``sysconf``); None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device: torch.device, local_ranks: int) -> tuple[float, str] | None:
    """Bytes one rank may use on ``device`` and what they are: the CUDA device's total memory, or
    the host's RAM divided among its ``local_ranks`` ranks. None when unknown."""
    if device.type == "cuda":
        index = device.index if device.index is not None else \
            int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
        total = torch.cuda.get_device_properties(index).total_memory
        return float(total), f"the {total / GIB:.1f} GiB of cuda:{index}"
    ram = host_memory_bytes()
    if ram is None:
        return None
    shared = f", shared by {local_ranks} ranks on this host" if local_ranks > 1 else ""
    return ram / local_ranks, f"this host's RAM ({ram / GIB:.1f} GiB{shared})"


def predicted_peak(run: ResolvedRun, device_type: str, capacity: float = float("inf")) -> Memory:
    """The planner's bytes per rank on the busiest pipeline stage of ``run`` on ``device_type``."""
    cfg, pc = run.cfg, run.cfg.parallel
    precision = planner_precision(cfg.train.precision, device_type)
    workspace = WORKSPACE_BYTES if device_type == "cuda" else 0.0
    peaks = []
    for stage in range(pc.pp):
        layers = stage_layer_ids(cfg.model.layers, pc.pp, pc.virtual_stages, stage)
        layout = run_layout(cfg.model, tp=pc.tp, pp=pc.pp, dp=run.dp, virtual_stages=pc.virtual_stages,
                            micro_batch=cfg.train.micro_batch, data_parallel=run.dp_mode, cp=pc.cp, stage_layers=layers,
                            ep=pc.ep)
        peaks.append(stage_memory(cfg.model, layout, capacity, run.global_batch, stage, precision,
                                  device=device_type, workspace=workspace))
    return max(peaks, key=lambda m: m.total)


def check_memory(run: ResolvedRun, device: torch.device | str, local_ranks: int = 1) -> None:
    """Raise :class:`~seqpar.errors.UserError` (one line: the estimate, the memory, the largest
    term) when ``run``'s predicted peak per rank exceeds what a rank of ``device`` has
    (:func:`device_memory`). Pure arithmetic on the resolved run: every rank raises the same error
    before any collective."""
    if not run.cfg.train.memory_check:
        return
    device = torch.device(device)
    have = device_memory(device, local_ranks)
    if have is None:
        return
    capacity, what = have
    memory = predicted_peak(run, device.type, capacity)
    if memory.fits:
        return
    name, size = max(((k, v) for k, v in memory.parts.items() if k != "workspace"), key=lambda kv: kv[1])
    stage = f" (pipeline stage {memory.stage})" if run.cfg.parallel.pp > 1 else ""
    raise UserError(f"predicted peak memory {memory.total / GIB:.1f} GiB per rank{stage} exceeds {what}; the "
                    f"largest term is {name} ({size / GIB:.1f} GiB). Shrink model.layers, model.seq_len, "
                    f"model.hidden or train.micro_batch, or split the model further (parallel.tp, parallel.pp, "
                    f"model.recompute); seqpar train --dry-run shows every term, and train.memory_check=false "
                    f"skips this check")


__all__ = ["check_memory", "device_memory", "host_memory_bytes", "predicted_peak"]
