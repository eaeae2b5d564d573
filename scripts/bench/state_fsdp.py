"""Training state and step time per rank: ddp against fsdp (both reshard settings) at t=2 x dp=2.

    python scripts/bench/state_fsdp.py [--steps 6] [--hidden 128] [--layers 4]

Trains the same model (SP, selective recompute, fp32, global batch 8 as 2 micro-batches of 2 per
dp rank) on 4 local gloo ranks with ``parallel.data_parallel`` ddp, fsdp with
``reshard_after_forward=true`` (ZeRO-3-like) and fsdp with ``false`` (ZeRO-2-like), the layouts
taking turns one step at a time so that a change in the machine's load hits them alike. Prints
the state each rank holds, measured on its tensors (the Trainer's ``state:`` line) and from
:func:`seqpar.memory.state.state_bytes_formula`, and the median step time with its ratio to ddp.
A benchmark, not a test: on a shared machine the times move with the load.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from seqpar.config import load_run_config
from seqpar.distributed import init_parallel, run_local
from seqpar.memory.state import state_bytes_formula
from seqpar.train import Trainer

LAYOUTS = {"ddp": ["parallel.data_parallel=ddp"],
           "fsdp (reshard after forward)": ["parallel.data_parallel=fsdp", "parallel.reshard_after_forward=true"],
           "fsdp (keep until backward)": ["parallel.data_parallel=fsdp", "parallel.reshard_after_forward=false"]}


def _overrides(tmp: Path, hidden: int, layers: int, steps: int) -> list[str]:
    np.save(tmp / "tokens.npy", np.random.default_rng(0).integers(0, 1024, 200_000).astype(np.uint16))
    return [f"data.source={tmp / 'tokens.npy'}", "model.vocab_size=1024", "model.seq_len=128",
            f"model.hidden={hidden}", "model.heads=4", f"model.layers={layers}", "model.sequence_parallel=true",
            "model.recompute=selective", "parallel.tp=2", f"train.steps={steps}", "train.micro_batch=2",
            "train.global_batch=8", "train.eval_interval=0", "train.precision=fp32", "train.log_interval=1000",
            f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.resume=never", f"out_dir={tmp / 'out'}"]


def _rank(rank: int, world: int, base: list[str], steps: int) -> dict:
    root = Path(base[0].split("=", 1)[1]).parent  # each layout its own checkpoint dir (one job per dir)
    trainers = {name: Trainer(load_run_config(None, base + extra + [f"checkpoint.dir={root / f'ckpt{i}'}",
                                                                   f"out_dir={root / f'out{i}'}"]),
                              mesh=init_parallel(tp=2))
                for i, (name, extra) in enumerate(LAYOUTS.items())}
    times: dict[str, list[float]] = {name: [] for name in trainers}
    try:
        for step in range(steps):
            for name, tr in trainers.items():
                t0 = time.perf_counter()
                tr.train_step(step)
                times[name].append(time.perf_counter() - t0)
        return {name: (tr.state, times[name][1:]) for name, tr in trainers.items()}  # step 0 warms up
    finally:
        for tr in trainers.values():
            tr.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = _overrides(Path(tmp), args.hidden, args.layers, args.steps)
        res = run_local(_rank, 4, base, args.steps, timeout=1800)[0]
        model = load_run_config(None, base).model
    ddp_time = statistics.median(res["ddp"][1])
    print(f"t=2 x dp=2, h={args.hidden}, L={args.layers}, s=128, fp32, {args.steps - 1} timed steps (median)\n")
    print("| data_parallel | state measured (MiB) | formula (MiB) | parameters / gradients / optimizer (MiB) "
          "| step (s) | vs ddp |")
    print("|---|---|---|---|---|---|")
    for name, (state, times) in res.items():
        mode = "ddp" if name == "ddp" else "fsdp"
        formula = state_bytes_formula(model, t=2, dp=2, data_parallel=mode)
        formula_mib = sum(formula[k] for k in ("parameters", "gradients", "optimizer")) / 2**20
        parts = " / ".join(f"{state[k] / 2**20:.2f}" for k in ("parameters", "gradients", "optimizer"))
        step = statistics.median(times)
        print(f"| {name} | {sum(state.values()) / 2**20:.2f} | {formula_mib:.2f} | {parts} | {step:.3f} "
              f"| {step / ddp_time:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
