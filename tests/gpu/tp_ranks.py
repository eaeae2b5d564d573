"""Ranks of the multi-rank correctness check: the comparison with the reference at t = world
size with sequence parallelism. Under run_local on the CPU (gloo), or as a script on one GPU per
rank (NCCL): ``torchrun --nproc-per-node N -m gpu.tp_ranks OUT.json`` with tests/ on PYTHONPATH."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from seqpar.distributed import init_parallel

from .helpers import Shapes
from .reference import correctness_variants


def tp_rank(rank: int, world_size: int, device: str) -> list:
    """This rank's (dtype, attention, result) of every variant (the results agree across ranks)."""
    mesh = init_parallel(tp=world_size)
    if mesh.device.type != device:
        raise RuntimeError(f"the correctness check at t={world_size} on {device} got a mesh on {mesh.device}")
    return correctness_variants(Shapes.for_device(device), mesh, sp=True)


if __name__ == "__main__":  # OUT.json [DEVICE, default cuda]
    results = tp_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), (sys.argv[2:] or ["cuda"])[0])
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.destroy_process_group()
