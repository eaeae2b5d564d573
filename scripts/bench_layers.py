"""Time forward+backward of a column -> GeLU -> row MLP (or a whole transformer layer):
t=2 SP, t=2 plain TP and t=1, on CPU gloo.

    python scripts/bench_layers.py [--layer mlp|block] [--seq 512 --batch 4 --hidden 512 --repeats 20]

The three configurations run interleaved round by round, so machine drift hits all of them
alike; the table shows the median time per step and the ratio to plain TP.
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


def _step(layer, x, dy):
    layer(x).backward(dy)


class _MLP(torch.nn.Module):
    def __init__(self, h, group, sp):
        super().__init__()
        self.col = ColumnParallelLinear(h, 4 * h, tp_group=group, sequence_parallel=sp)
        self.row = RowParallelLinear(4 * h, h, tp_group=group, sequence_parallel=sp)

    def forward(self, x):
        return self.row(F.gelu(self.col(x)))


def _layer(kind, args, group, sp):
    """The column -> GeLU -> row MLP, or a whole transformer layer (LayerNorms, attention, MLP,
    dropout 0.1, residuals) as in the paper's Table 4."""
    h = args.hidden
    if kind == "mlp":
        return _MLP(h, group, sp)
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq, hidden=h, heads=args.heads, layers=1, dropout=0.1,
                    attention_dropout=0.1, sequence_parallel=sp, recompute="none")
    rank = 0 if group is None else dist.get_rank(group)
    streams = RNGStreams(0, tp_rank=rank)
    return Block(cfg, group, streams, (0.02, 0.02))


def _worker(rank, world, args) -> dict[str, list[float]]:
    """One of the two ranks (run_local: gloo, one thread): time SP and plain TP round-robin."""
    g = dist.group.WORLD
    s, b, h = args.seq, args.batch, args.hidden
    torch.manual_seed(0)
    x_full, dy_full = torch.randn(s, b, h), torch.randn(s, b, h)
    configs = {
        "t=2 SP": (_layer(args.layer, args, g, True), chunk_of(x_full, g, 0).clone(), chunk_of(dy_full, g, 0).clone()),
        "t=2 TP": (_layer(args.layer, args, g, False), x_full, dy_full),
    }
    times = {k: [] for k in configs}
    for it in range(args.warmup + args.repeats):
        for name, (layer, x, dy) in configs.items():
            dist.barrier()
            t0 = time.perf_counter()
            _step(layer, x.requires_grad_(True), dy)
            dist.barrier()
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def _single(args) -> list[float]:
    torch.set_num_threads(1)  # one core per rank, like each TP rank above
    s, b, h = args.seq, args.batch, args.hidden
    torch.manual_seed(0)
    layer = _layer(args.layer, args, None, False)
    x, dy = torch.randn(s, b, h, requires_grad=True), torch.randn(s, b, h)
    out = []
    for it in range(args.warmup + args.repeats):
        t0 = time.perf_counter()
        _step(layer, x, dy)
        if it >= args.warmup:
            out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layer", choices=("mlp", "block"), default="mlp",
                   help="mlp: column -> GeLU -> row; block: a whole transformer layer (paper Table 4)")
    p.add_argument("--heads", type=int, default=8)
    args = p.parse_args(argv)
    what = "MLP" if args.layer == "mlp" else f"transformer layer (a={args.heads}, dropout 0.1)"
    print(f"{what} [s={args.seq}, b={args.batch}, h={args.hidden}, ffn={4 * args.hidden}], fp32, CPU gloo, "
          f"{args.repeats} timed steps after {args.warmup} warm-up, {os.cpu_count()} cores", flush=True)
    times = run_local(_worker, 2, args, timeout=None)[0]  # rank 0's timings
    times["t=1"] = _single(args)
    base = statistics.median(times["t=2 TP"])
    print("\n| config | median ms / step | min ms | ratio to t=2 TP |\n|---|---|---|---|")
    for name in ("t=2 SP", "t=2 TP", "t=1"):
        med = statistics.median(times[name])
        print(f"| {name} | {med * 1e3:.2f} | {min(times[name]) * 1e3:.2f} | {med / base:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
