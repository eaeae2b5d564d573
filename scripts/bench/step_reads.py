"""The Trainer's own step before and after its recipe lost its per-step host work, in one run.

    python scripts/bench/step_reads.py [--steps 20] [--layers 4] [--hidden 128] [--accum 4]

One process, the bf16 recipe (fp32 masters, bf16 compute copies), ``--accum`` micro-batches per
step; three Trainers stepped in turn (interleaved, so load on the machine hits each alike):

* ``before``: the recipe as it was: a cast (or add) per parameter for the bf16 copies and the fp32
  master gradients, the step's flags read on the host every step, foreach AdamW;
* ``after, foreach AdamW``: multi-tensor casts; foreach AdamW still reads the flags to skip a
  non-finite step (the CPU default: there the read waits on no device);
* ``after, fused AdamW``: multi-tensor casts; the skip on the device (``found_inf``), nothing read
  in a step that does not log (the CUDA default).

Prints the median step time of steps that do not log and the host reads per such step
(:class:`seqpar.tools.host_reads.HostReads`; on CUDA each is a device sync).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch

import seqpar.train.trainer as trainer_module
from seqpar.config import load_run_config
from seqpar.distributed.mesh import ParallelMesh
from seqpar.tools.host_reads import HostReads
from seqpar.train import Trainer
from seqpar.train.optim import build_optimizer


def _per_parameter_weights(self, model):
    """The bf16 copies as the recipe made them before: one cast per parameter."""
    return {n: p.detach().to(torch.bfloat16).requires_grad_(p.requires_grad) for n, p in model.named_parameters()}


@torch.no_grad()
def _per_parameter_accumulate(self, model, weights):
    """The fp32 master gradients as the recipe made them before: one cast or add per parameter."""
    if weights is None:
        return
    for name, p in model.named_parameters():
        g = weights[name].grad
        if g is not None:
            p.grad = g.to(torch.float32) if p.grad is None else p.grad.add_(g)
            weights[name].grad = None


def _fused(model, **kwargs):
    return build_optimizer(model, fused=True, **kwargs)


def _trainer(tmp: Path, args, name: str, fused: bool) -> Trainer:
    tokens = tmp / "tokens.npy"
    if not tokens.exists():
        np.save(tokens, np.random.default_rng(0).integers(0, 256, size=200_000).astype(np.uint16))
    overrides = {"model.vocab_size": 256, "model.seq_len": 64, "model.hidden": args.hidden, "model.heads": 4,
                 "model.layers": args.layers, "model.dropout": 0.0, "model.attention_dropout": 0.0,
                 "train.precision": "bf16", "train.micro_batch": 2, "train.global_batch": 2 * args.accum,
                 "train.steps": 10_000, "train.log_interval": 10_000, "train.eval_interval": 0,
                 "checkpoint.interval": 0, "checkpoint.resume": "never", "data.source": str(tokens),
                 "data.cache_dir": str(tmp / "cache"), "checkpoint.dir": str(tmp / name / "ckpt"),
                 "out_dir": str(tmp / name / "out")}
    trainer_module.build_optimizer = _fused if fused else build_optimizer
    try:
        trainer = Trainer(load_run_config(None, [f"{k}={v}" for k, v in overrides.items()]),
                          mesh=ParallelMesh.single())
    finally:
        trainer_module.build_optimizer = build_optimizer
    trainer.logger.enabled = False
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--accum", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = {"before": _trainer(Path(tmp), args, "before", fused=False),
                "after, foreach AdamW (CPU default)": _trainer(Path(tmp), args, "foreach", fused=False),
                "after, fused AdamW (CUDA default)": _trainer(Path(tmp), args, "fused", fused=True)}
        before = runs["before"].precision
        before.compute_weights = types.MethodType(_per_parameter_weights, before)
        before.accumulate = types.MethodType(_per_parameter_accumulate, before)
        times = {name: [] for name in runs}
        reads = {name: 0 for name in runs}
        try:
            for step in range(args.steps + 2):
                for name, trainer in runs.items():
                    t0 = time.perf_counter()
                    with HostReads() as counter:
                        trainer.train_step(step)
                    if step >= 2:  # the first steps measure activations and state
                        times[name].append(time.perf_counter() - t0)
                        reads[name] += len(counter.reads)
            losses = {name: trainer.train_step(args.steps + 2).loss for name, trainer in runs.items()}
        finally:
            for trainer in runs.values():
                trainer.close()
    print(f"bf16 recipe, {args.layers}L h={args.hidden} s=64, {args.accum} micro-batches of 2 per step, "
          f"{args.steps} steps that do not log, {torch.get_num_threads()} thread(s), device cpu\n")
    print(f"| {'recipe':<36} | median step ms | host reads / step | loss after {args.steps + 3} steps |")
    print(f"|{'-' * 38}|----------------|-------------------|{'-' * 23}|")
    for name in runs:
        print(f"| {name:<36} | {statistics.median(times[name]) * 1e3:14.2f} | {reads[name] / args.steps:17.2f} "
              f"| {losses[name]:21.6f} |")


if __name__ == "__main__":
    main()
