"""Start gloo ranks with torch.multiprocessing and a file:// rendezvous (never a guessed port)."""
from __future__ import annotations

import os
import pickle
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


TIMEOUT = timedelta(seconds=60)  # a rank stuck in a collective fails the test instead of hanging it


def _entry(rank, fn, world_size, init_file, out_dir, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, tmp_path: Path, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result.

    ``fn`` must be a module-level function. Exceptions on any rank fail the calling test.
    """
    run_dir = Path(tmp_path) / f"ranks-{uuid.uuid4().hex[:8]}"
    run_dir.mkdir(parents=True)
    mp.spawn(_entry, args=(fn, world_size, str(run_dir / "rendezvous"), str(run_dir), args), nprocs=world_size,
             join=True)
    results = []
    for r in range(world_size):
        with open(run_dir / f"rank{r}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def tp_group_of(t: int):
    """Split the world into consecutive groups of ``t`` ranks; return this rank's (None for t=1).
    Every rank must call this with the same ``t`` (``new_group`` is collective)."""
    if t == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for start in range(0, world, t):
        g = dist.new_group(list(range(start, start + t)))
        if start <= rank < start + t:
            mine = g
    return mine


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(|b|, tiny)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
