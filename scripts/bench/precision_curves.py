"""bf16 (the paper's recipe) against fp32 on the tiny config: loss curves side by side.

    python scripts/bench/precision_curves.py [--steps 200] [--tolerance 0.05]

Trains the same model (tiny-cpu's shape, t=2, SP, selective recompute) on 2 local gloo ranks in
both precisions from the same seed and data, and prints the mean training loss of each block of
steps, the difference, and whether the last block differs by at most ``--tolerance`` (relative).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from seqpar.config import load_run_config
from seqpar.distributed import init_parallel, run_local
from seqpar.train import Trainer


def _run(rank: int, world: int, overrides: list[str]) -> list[float]:
    trainer = Trainer(load_run_config("tiny-cpu", overrides), mesh=init_parallel(tp=2))
    try:
        return [trainer.train_step(step).loss for step in range(trainer.run.cfg.train.steps)]
    finally:
        trainer.close()


def curves(steps: int, root: Path) -> dict[str, list[float]]:
    out = {}
    for precision in ("fp32", "bf16"):
        overrides = [f"train.steps={steps}", f"train.precision={precision}", "train.eval_interval=0",
                     "checkpoint.resume=never", f"checkpoint.dir={root / precision / 'ckpt'}",
                     f"out_dir={root / precision}", "train.log_interval=1000"]
        out[precision] = run_local(_run, 2, overrides, timeout=3600)[0]
        print(f"{precision}: {steps} steps done", file=sys.stderr, flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--block", type=int, default=25, help="steps averaged per table row")
    ap.add_argument("--tolerance", type=float, default=0.05, help="relative difference allowed at the end")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = curves(args.steps, Path(tmp))
    print("| steps | fp32 loss | bf16 loss | bf16 / fp32 |\n|---|---|---|---|")
    rows = []
    for start in range(0, args.steps, args.block):
        a, b = (sum(result[p][start:start + args.block]) / len(result[p][start:start + args.block])
                for p in ("fp32", "bf16"))
        rows.append(b / a)
        print(f"| {start + 1}-{min(start + args.block, args.steps)} | {a:.4f} | {b:.4f} | {b / a:.4f} |")
    ok = abs(rows[-1] - 1) <= args.tolerance
    print(f"\nlast block: bf16 / fp32 = {rows[-1]:.4f} ({'within' if ok else 'OUTSIDE'} {args.tolerance:.0%})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
