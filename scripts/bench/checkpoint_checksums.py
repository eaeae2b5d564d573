"""What checkpoint checksums cost: save and load of one rank's shard, with and without them.

    python scripts/bench/checkpoint_checksums.py [--hidden 1536] [--layers 1] [--reps 3] [--dir /tmp]

The model is the 1.3B shape's width class cut to one rank's share of a checkpoint: with the
defaults its parameters and AdamW moments make a ~340 MB shard (one rank's shard of the 1.3B
model at t=8 over its layers is of this order). "save" is :func:`save_checkpoint` (DCP shards,
RNG, config, fsync, marker); "without" replaces the CRC-32 with a constant, so the difference is
what reading each file back once and checksumming it costs. "load" is :func:`load_checkpoint` with
``verify`` on and off. One process, one thread; medians over ``--reps`` runs after one warm-up.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from seqpar.checkpoint import files, integrity, load_checkpoint, save_checkpoint, save_load, writer
from seqpar.model import GPT, GPTConfig
from seqpar.train.optim import build_optimizer


@contextmanager
def _no_checksums():
    """CRC-32 replaced by a constant in every module that takes one."""
    saved = (files.file_checksum, save_load.file_checksum, integrity.checksums, writer.checksums)
    files.file_checksum = save_load.file_checksum = lambda path: "00000000"
    integrity.checksums = writer.checksums = lambda folder, names: {n: "00000000" for n in names}
    try:
        yield
    finally:
        files.file_checksum, save_load.file_checksum, integrity.checksums, writer.checksums = saved


def _model(args):
    cfg = GPTConfig(vocab_size=1024, seq_len=128, hidden=args.hidden, heads=16, layers=args.layers, dropout=0.0,
                    attention_dropout=0.0)
    model = GPT(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p)}
    return model, opt


def _median(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: the system's temp dir)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model, opt = _model(args)
    root = Path(tempfile.mkdtemp(dir=args.dir))
    step = [0]

    def save():
        step[0] += 1
        return save_checkpoint(root, step[0], model, opt, {"tp": 1}, "model: {}\n", model.rng, keep=1)

    try:
        with_sums = _median(save, args.reps)
        with _no_checksums():
            without = _median(save, args.reps)
        folder = save()
        size = sum(f.stat().st_size for f in folder.iterdir())
        verified = _median(lambda: load_checkpoint(folder, model, opt, model.rng, verify=True), args.reps)
        unverified = _median(lambda: load_checkpoint(folder, model, opt, model.rng, verify=False), args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint of {size / 1e6:.0f} MB (hidden {args.hidden}, {args.layers} layer(s), parameters + AdamW "
          f"moments), medians of {args.reps}")
    print(f"{'':6} {'without CRC-32 (s)':>19} {'with CRC-32 (s)':>16} {'ratio':>6} {'MB/s of CRC':>12}")
    for name, off, on in (("save", without, with_sums), ("load", unverified, verified)):
        extra = on - off
        rate = f"{size / 1e6 / extra:.0f}" if extra > 0 else "-"
        print(f"{name:6} {off:19.3f} {on:16.3f} {on / off:6.2f} {rate:>12}")


if __name__ == "__main__":
    main()
