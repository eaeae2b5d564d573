"""The planner's step-time predictions against measured steps, on 2 CPU gloo ranks of this machine.

    python scripts/bench/plan_vs_measured.py [--steps 8]

Two small models, each trained for a few steps per layout on 2 ranks (global batch 4, micro-batch 2):

* recompute: an attention-heavy shape (s = 1024, h = 256, 4 heads, 2 layers) at t = 2 with SP,
  recompute none / selective / full;
* t: a parameter-heavy shape (s = 128, h = 1024, 8 heads, 2 layers, vocabulary 16384) with
  selective recompute at t = 1 (dp = 2, DDP: whole optimizer and gradient all-reduce on each
  rank) and t = 2 (SP: half of both).

Before each, both ranks measure this machine as the planner's device (fastest of several calls): the fp32 GEMM rate at two
reduction lengths (4h and the head dim; from them the peak and K0 of
``seqpar.plan.kernels``, with E = 1 and one SM), the bandwidth of an elementwise add and gloo's
all-reduce bandwidth and latency between the ranks. Prints predicted against measured seconds
per step (the fastest of ``--steps`` rounds; the layouts take turns, one step each per round, so
a change in load hits them alike) and whether both rank the layouts in the same order. A
benchmark, not a test: on a shared machine the numbers move with the load.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from torch.nn.parallel import DistributedDataParallel

from seqpar.distributed.grad_sync import sync_sp_replicated_grads
from seqpar.distributed.local import run_local
from seqpar.distributed.mesh import ParallelMesh
from seqpar.model import GPT, GPTConfig
from seqpar.plan.gpus import GIB, GPU
from seqpar.plan.layout import Layout, Recompute
from seqpar.plan.search import Problem, evaluate

MICRO_BATCH, GLOBAL_BATCH = 2, 4



def _best(fn, repeats: int = 5) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up: load from other processes only slows a
    call down, so the fastest is the least disturbed."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _rates(cfg: GPTConfig, world: int) -> dict[str, float]:
    """Measured on each rank at once: GEMM FLOP/s at K = 4h (the longest dense reduction) and K = head
    dim (the attention core's), elementwise bytes/s, gloo all-reduce bus bandwidth and latency."""
    m, n, k, d = cfg.seq_len * MICRO_BATCH, cfg.hidden, 4 * cfg.hidden, cfg.head_dim
    a, b = torch.randn(m, k), torch.randn(k, n)
    c, e = torch.randn(16, m, d), torch.randn(16, d, m // 4)
    x, y, z = torch.randn(8 << 20), torch.randn(8 << 20), torch.empty(8 << 20)
    buf, one = torch.randn(4 << 20), torch.zeros(1)
    dist.barrier()
    return {"gemm_big": 2 * m * n * k / _best(lambda: a @ b),
            "gemm_small": 2 * 16 * m * (m // 4) * d / _best(lambda: c @ e),
            "memory": 3 * x.numel() * 4 / _best(lambda: torch.add(x, y, out=z)),
            "gloo_latency": _best(lambda: dist.all_reduce(one), 20),
            "gloo_bw": 2 * (world - 1) / world * buf.numel() * 4 / _best(lambda: dist.all_reduce(buf), 3)}


def cpu_device(rates: dict[str, float], k_big: int, k_small: int) -> GPU:
    """The planner's device from the measured rates: r(K) = peak K / (K + K0) through both GEMMs."""
    r1, r2 = rates["gemm_big"], rates["gemm_small"]
    k0 = max(0.0, (r1 - r2) / (r2 / k_small - r1 / k_big))
    peak = r1 * (k_big + k0) / k_big
    return GPU("cpu-gloo", peak, 64 * GIB, rates["memory"], rates["gloo_bw"], rates["gloo_bw"], sms=1,
               gemm_efficiency=1.0, gemm_k_overhead=k0, hbm_efficiency=1.0, nvlink_efficiency=1.0,
               ib_efficiency=1.0, collective_latency=rates["gloo_latency"], p2p_latency=rates["gloo_latency"],
               fp32_scale=1.0)


def _mesh(t: int, rank: int, world: int) -> ParallelMesh:
    if t == world:
        return ParallelMesh.for_tp_group(dist.group.WORLD)
    return ParallelMesh(1, world, 0, rank, rank, world, torch.device("cpu"), None, dist.group.WORLD)


class _Trainer:
    """One layout of the model on this rank: DDP over dp when dp > 1, SP grads summed over TP."""

    def __init__(self, cfg: GPTConfig, t: int, rank: int, world: int) -> None:
        self.mesh = _mesh(t, rank, world)
        self.model = GPT(cfg, self.mesh, seed=0)
        self.net = self.model if self.mesh.dp_size == 1 else DistributedDataParallel(
            self.model, process_group=self.mesh.dp_group)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.micro = GLOBAL_BATCH // (self.mesh.dp_size * MICRO_BATCH)
        gen = torch.Generator().manual_seed(self.mesh.dp_rank)
        self.tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=gen)

    def step(self) -> float:
        dist.barrier()
        start = time.perf_counter()
        for i in range(self.micro):
            skip_sync = self.mesh.dp_size > 1 and i < self.micro - 1
            with self.net.no_sync() if skip_sync else contextlib.nullcontext():
                (self.net(self.tokens, self.tokens) / self.micro).backward()
        if self.mesh.tp_size > 1:
            sync_sp_replicated_grads(self.model, self.mesh.tp_group)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start


def _rank(rank: int, world: int, cfgs: list[tuple[int, GPTConfig]], steps: int) -> tuple[dict, list[list[float]]]:
    """Measure the device, then train every layout in turn, one step each per round."""
    rates = _rates(cfgs[0][1], world)
    trainers = [_Trainer(cfg, t, rank, world) for t, cfg in cfgs]
    for tr in trainers:
        tr.step()  # warm-up
    times = [[] for _ in trainers]
    for _ in range(steps):
        for i, tr in enumerate(trainers):
            times[i].append(tr.step())
    return rates, times


EXPERIMENTS = {  # name: (model shape, layouts as (t, recompute))
    "recompute at t=2": (dict(seq_len=1024, hidden=256, heads=4, layers=2, vocab_size=4096),
                         [(2, "none"), (2, "selective"), (2, "full")]),
    "t at selective": (dict(seq_len=128, hidden=1024, heads=8, layers=2, vocab_size=16384),
                       [(1, "selective"), (2, "selective")]),
}


def _order(values: dict) -> list:
    return sorted(values, key=values.get)


def experiment(name: str, shape: dict, layouts: list[tuple[int, str]], steps: int) -> bool:
    """Measure, predict, print the table; True when both rank the layouts in the same order."""
    base = GPTConfig(**shape, dropout=0.0, attention_dropout=0.0, attention="math")
    cfgs = [(t, replace(base, recompute=rc, sequence_parallel=t > 1)) for t, rc in layouts]
    ranks = run_local(_rank, 2, cfgs, steps, timeout=None)
    worst = {k: (max if k == "gloo_latency" else min)(r[0][k] for r in ranks) for k in ranks[0][0]}
    device = cpu_device(worst, 4 * base.hidden, base.head_dim)
    print(f"\n## {name}: {shape}, micro-batch {MICRO_BATCH}, global batch {GLOBAL_BATCH}, fp32, 2 gloo ranks")
    print(f"device: GEMM peak {device.peak_flops / 1e9:.1f} GFLOP/s per rank, K0 {device.gemm_k_overhead:.0f}, "
          f"memory {device.hbm_bw / 1e9:.1f} GB/s, gloo {device.nvlink_bw / 1e9:.2f} GB/s + "
          f"{1e6 * device.collective_latency:.0f} us\n")
    print("| layout | predicted s/step | measured s/step (fastest) | measured / predicted |\n|---|---|---|---|")
    predicted, measured = {}, {}
    for i, (t, cfg) in enumerate(cfgs):
        key = f"t={t} dp={2 // t} {cfg.recompute}"
        layout = Layout(tp=t, pp=1, dp=2 // t, micro_batch=MICRO_BATCH, sequence_parallel=t > 1,
                        recompute=Recompute(cfg.recompute))
        predicted[key] = evaluate(Problem(cfg, 2, device, GLOBAL_BATCH, 2, "fp32"), layout).time.seconds
        measured[key] = min(max(pair) for pair in zip(ranks[0][1][i], ranks[1][1][i]))
        print(f"| {key} | {predicted[key]:.3f} | {measured[key]:.3f} | {measured[key] / predicted[key]:.2f} |")
    pred, meas = _order(predicted), _order(measured)
    print(f"predicted order {pred}; measured order {meas}: {'same' if pred == meas else 'DIFFERENT'}")
    return pred == meas


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="measured rounds (one step per layout each, after a warm-up)")
    args = p.parse_args(argv)
    same = [experiment(name, shape, layouts, args.steps) for name, (shape, layouts) in EXPERIMENTS.items()]
    print(f"\nsame order in {sum(same)} of {len(same)} comparisons")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
