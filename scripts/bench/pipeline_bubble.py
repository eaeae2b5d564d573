"""Measured pipeline bubble of the first stage, 1F1B against interleaved 1F1B, on p=2 gloo ranks.

    python scripts/bench/pipeline_bubble.py [--layers 8] [--hidden 256] [--seq 128] [--micro 4 8] [--steps 5]

Each rank is one CPU process (one thread). The bubble is the first stage's idle time per step
(waiting on its neighbour: warm-up, cool-down, transfers) over its busy time (forward and
backward chunks), the median over ``--steps`` steps after one warm-up step, printed next to the
schedules' ideal ``(p-1)/(m n)``. Idle share of the step = bubble / (1 + bubble).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from seqpar.distributed import init_parallel, run_local
from seqpar.model import GPTConfig
from seqpar.parallel import build_pipeline

LAYOUTS = (("1F1B", 1), ("Interleaved1F1B", 2))


def _entry(rank: int, world: int, args: argparse.Namespace) -> list[tuple]:
    """One rank: every (schedule, micro-batch count) for ``args.steps`` steps; rows from stage 0."""
    mesh = init_parallel(1, pp=world)
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq, hidden=args.hidden, heads=4, layers=args.layers,
                    dropout=0.0, attention_dropout=0.0, recompute="none")
    rows = []
    for schedule, m in LAYOUTS:
        for n in args.micro:
            pipe = build_pipeline(cfg, mesh, seed=0, schedule=schedule, virtual_stages=m, n_microbatches=n)
            tokens = torch.randint(0, 256, (n * args.micro_batch, args.seq))
            timings = []
            for _ in range(args.steps + 1):
                pipe.step(tokens, tokens)
                timings.append(pipe.last_timing)
            timings = timings[1:]
            bubble = statistics.median(t.bubble for t in timings)
            step_s = statistics.median(t.step_s for t in timings)
            rows.append((schedule, m, n, step_s, bubble, pipe.ideal_bubble()))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8], help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    rows = run_local(_entry, args.pp, args, timeout=1800)[0]
    print(f"p={args.pp}, L={args.layers}, h={args.hidden}, s={args.seq}, b={args.micro_batch}, CPU gloo, "
          f"first stage")
    print("| schedule | m | micro-batches n | step (s) | measured bubble | (p-1)/(m n) |")
    print("|---|---|---|---|---|---|")
    for schedule, m, n, step_s, bubble, ideal in rows:
        print(f"| {schedule} | {m} | {n} | {step_s:.3f} | {bubble:.3f} | {ideal:.3f} |")


if __name__ == "__main__":
    main()
