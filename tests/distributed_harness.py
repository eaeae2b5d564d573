"""Helpers for multi-rank tests: ranks come from seqpar's local launcher (file:// rendezvous)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from seqpar.distributed.local import run_local

COLLECTIVE_TIMEOUT_S = 60  # a rank stuck in a collective fails the test instead of hanging it
TEST_TIMEOUT_S = 600       # a whole multi-rank call past this is killed


def run_ranks(fn, world_size: int, tmp_path: Path, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function. An exception on any rank fails the calling test with
    that rank's traceback (:class:`seqpar.distributed.local.RankFailed`).
    """
    return run_local(fn, world_size, *args, timeout=TEST_TIMEOUT_S, collective_timeout=COLLECTIVE_TIMEOUT_S,
                     tmp_dir=tmp_path)


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
