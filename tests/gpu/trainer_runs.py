"""Trainer runs of the GPU checks, through seqpar's public API: ``tiny-cpu`` shrunk per device."""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

from run_helpers import random_tokens
from seqpar.config import load_run_config
from seqpar.distributed import ParallelMesh
from seqpar.train import Trainer


def run_config(tmp: Path, shapes, name: str, overrides: list[str]):
    """``tiny-cpu`` with ``shapes.run_model``: global batch 4, fp32, no eval, no periodic checkpoints,
    its own dirs under ``tmp/name``; ``overrides`` last."""
    tokens = random_tokens(tmp / "tokens.npy", vocab=2048, size=200_000)  # tiny-cpu's vocabulary
    base = [f"data.source={tokens}", "parallel.tp=1", "train.global_batch=4", "train.micro_batch=4",
            "train.precision=fp32", "train.eval_interval=0", "train.log_interval=1000", "train.warmup_steps=2",
            "train.steps=4", "checkpoint.interval=0", "checkpoint.resume=never",
            f"checkpoint.dir={tmp / name / 'ckpt'}", f"out_dir={tmp / name / 'out'}"]
    return load_run_config("tiny-cpu", base + shapes.run_model + overrides)


def train_losses(cfg, mesh: ParallelMesh, steps: int | None = None) -> list[float]:
    """The losses of the first ``steps`` optimizer steps (default ``train.steps``) of a Trainer."""
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's banner and resolved config
        trainer = Trainer(cfg, mesh=mesh)
        try:
            return [trainer.train_step(s).loss for s in range(steps or cfg.train.steps)]
        finally:
            trainer.close()


def quiet_fit(cfg, mesh: ParallelMesh) -> tuple[dict, str]:
    """``Trainer(cfg, mesh).fit()`` with its printing captured: (history, printed text)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = Trainer(cfg, mesh=mesh).fit()
    return history, out.getvalue()
