"""Time forward+backward of the SP MLP pair (column -> GeLU -> row) or a whole transformer layer at
t=2 on CPU gloo, with overlapped TP communication off and on (``parallel.tp_overlap``).

    python scripts/bench/tp_overlap.py [--layer mlp|block] [--seq 512 --batch 4 --hidden 512 --repeats 20]

The same layer (same weights) runs both ways, interleaved round by round so machine drift hits
both alike; the table shows the median and minimum time per step and the ratio on / off. A row
"GEMMs only" times the same per-rank matmuls without any communication: the floor overlap aims at.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from seqpar.distributed.collectives import chunk_of
from seqpar.distributed.local import run_local
from seqpar.distributed.rng import RNGStreams
from seqpar.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.model import Block, GPTConfig
from seqpar.parallel import apply_tp_overlap


class _MLP(torch.nn.Module):
    def __init__(self, h, group):
        super().__init__()
        self.col = ColumnParallelLinear(h, 4 * h, tp_group=group, sequence_parallel=True)
        self.row = RowParallelLinear(4 * h, h, tp_group=group, sequence_parallel=True)

    def forward(self, x):
        return self.row(F.gelu(self.col(x)))


def _layer(args, group):
    if args.layer == "mlp":
        return _MLP(args.hidden, group)
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq, hidden=args.hidden, heads=args.heads, layers=1, dropout=0.1,
                    attention_dropout=0.1, sequence_parallel=True, recompute="selective")
    return Block(cfg, group, RNGStreams(0, tp_rank=dist.get_rank(group)), (0.02, 0.02))


def _gemms_only(args, t):
    """The MLP's per-rank matmuls (forward, grad-input, weight-grad) with no collective at all."""
    s, b, h, f = args.seq, args.batch, args.hidden, 4 * args.hidden // t
    x, w1, w2 = torch.randn(s * b, h), torch.randn(f, h), torch.randn(h, f)

    def step():
        a = x @ w1.t()
        y = F.gelu(a)
        _ = y @ w2.t()
        dy = torch.ones(s * b, h)
        dg = dy @ w2
        _ = dy.t() @ y, dg.t() @ x, dg @ w1
    return step


def _time(fn, args, times, name, it):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    if it >= args.warmup:
        times.setdefault(name, []).append(time.perf_counter() - t0)


def _worker(rank, world, args) -> dict[str, list[float]]:
    """One rank (run_local: gloo, one thread): the layer with overlap off and on, round by round."""
    g = dist.group.WORLD
    torch.manual_seed(0)
    layer = _layer(args, g)
    x = chunk_of(torch.randn(args.seq, args.batch, args.hidden), g, 0).clone().requires_grad_(True)
    dy = chunk_of(torch.randn(args.seq, args.batch, args.hidden), g, 0).clone()
    gemms = _gemms_only(args, world) if args.layer == "mlp" else None
    times: dict[str, list[float]] = {}
    for it in range(args.warmup + args.repeats):
        for name, on in (("tp_overlap off", False), ("tp_overlap on", True)):
            apply_tp_overlap(layer, on)
            _time(lambda: layer(x).backward(dy), args, times, name, it)
        if gemms is not None:
            _time(gemms, args, times, "GEMMs only (no communication)", it)
    return times


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", choices=("mlp", "block"), default="mlp",
                   help="mlp: column -> GeLU -> row; block: a whole transformer layer (selective recompute)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args(argv)
    what = "SP MLP" if args.layer == "mlp" else f"transformer layer (a={args.heads}, dropout 0.1, selective)"
    print(f"{what} [s={args.seq}, b={args.batch}, h={args.hidden}, ffn={4 * args.hidden}], t=2, fp32, CPU gloo, "
          f"one thread per rank, {args.repeats} timed steps after {args.warmup} warm-up, {os.cpu_count()} cores",
          flush=True)
    times = run_local(_worker, 2, args, timeout=None)[0]  # rank 0's timings
    base = statistics.median(times["tp_overlap off"])
    print("\n| config | median ms / step | min ms | ratio to off |\n|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.2f} | {min(ts) * 1e3:.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
