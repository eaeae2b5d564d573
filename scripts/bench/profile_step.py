"""Profile one training step of each benchmark peer with torch.profiler (rank 0 of t=2 gloo ranks).

    python scripts/bench/profile_step.py [--systems seqpar,megatron-core] [--recompute selective] [--rows 15]

Prints, per system, the top operators by self CPU time, so the differences behind a step-time
ratio in `seqpar bench` can be read off op by op.
"""
from __future__ import annotations

import argparse
import sys

import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from seqpar.tools.bench.peer import BenchShape
from seqpar.tools.bench.runner import _batch, load_peer
from seqpar.tools.bench.seqpar_peer import gpt_config
from seqpar.distributed.local import run_local
from seqpar.distributed.mesh import ParallelMesh
from seqpar.model import GPT


def _entry(rank, world, args) -> None:
    """One of the ranks (run_local: gloo, one thread): profile each system; rank 0 prints."""
    shape = BenchShape(seq_len=args.seq, hidden=args.hidden, heads=args.heads, layers=args.layers)
    tokens, labels = _batch(shape, 0)
    dense = GPT(gpt_config(shape, "none"), ParallelMesh.for_tp_group(dist.group.WORLD), seed=0).dense_state_dict()
    for name in args.systems.split(","):
        peer = load_peer(name)
        peer.build(shape, dense, tp_group=dist.group.WORLD, tp_rank=rank, tp_size=world, recompute=args.recompute)
        for _ in range(2):
            peer.step(tokens, labels)
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                peer.step(tokens, labels)
        if rank == 0:
            print(f"\n=== {name}, recompute={args.recompute}, 3 steps, rank 0 ===")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="seqpar,megatron-core")
    p.add_argument("--recompute", default="selective")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=15)
    args = p.parse_args(argv)
    run_local(_entry, 2, args, timeout=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
