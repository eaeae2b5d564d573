"""Tiny training runs for tests: a token file under the test's folder and the overrides that point
a run's data, checkpoints and outputs there. Each test states the model and training settings it
needs; this module only does the plumbing they share."""
import subprocess
import time
from pathlib import Path

import numpy as np


def random_tokens(path: Path, vocab: int = 64, size: int = 6000, seed: int = 0) -> Path:
    """``size`` uniform token ids below ``vocab`` saved as ``.npy`` (written once per path)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        np.save(path, np.random.default_rng(seed).integers(0, vocab, size=size).astype(np.uint16))
    return path


def phrase_tokens(path: Path, vocab: int = 128, phrases: int = 6, length: int = 12, repeats: int = 4000) -> Path:
    """A learnable stream: random repetitions of a few fixed phrases (a loss that visibly falls)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        rng = np.random.default_rng(0)
        table = [rng.integers(0, vocab, size=length) for _ in range(phrases)]
        np.save(path, np.concatenate([table[i] for i in rng.integers(0, phrases, size=repeats)]).astype(np.uint16))
    return path


def run_overrides(tmp: Path, settings: dict, tokens: Path | None = None, out: str = "out", ckpt: str = "ckpt",
                  **extra) -> list[str]:
    """``key=value`` overrides: ``settings``, then ``extra`` (``a__b`` means ``a.b``; dotted keys pass
    as they are), with the data source (default: ``random_tokens(tmp / "tokens.npy")``),
    ``checkpoint.dir`` (``tmp / ckpt``) and ``out_dir`` (``tmp / out``) in ``tmp``."""
    cfg = {"data.source": str(tokens if tokens is not None else random_tokens(tmp / "tokens.npy")),
           "checkpoint.dir": str(tmp / ckpt), "checkpoint.resume": "never", "out_dir": str(tmp / out)}
    cfg.update(settings)
    cfg.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in cfg.items()]


# the tiny model most trainer tests train: small enough for several CPU ranks per test
TINY_MODEL = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16}
# TINY_MODEL with every TP split exercised at t = 2 (a padded vocabulary: 64 -> 66 rows, an untied
# output layer, sequence parallelism, selective recompute) and no dropout, so layouts compare exactly
SHARDED_RUN = {**TINY_MODEL, "model.vocab_multiple": 3, "model.heads": 4, "model.dropout": 0.0,
               "model.attention_dropout": 0.0, "model.sequence_parallel": True, "model.recompute": "selective",
               "model.tie_embeddings": False, "train.micro_batch": 2, "train.global_batch": 8,
               "train.warmup_steps": 2, "train.seed": 3, "train.precision": "fp32"}


# a run whose loss visibly falls in 20 steps: the end-to-end training and resume tests
LEARNABLE_RUN = {"model.vocab_size": 128, "model.seq_len": 32, "model.hidden": 32, "model.heads": 4,
                 "model.layers": 2, "model.dropout": 0.0, "model.attention_dropout": 0.0,
                 "train.steps": 20, "train.micro_batch": 4, "train.lr": 3e-3, "train.warmup_steps": 3,
                 "train.log_interval": 5, "train.eval_interval": 0, "train.seed": 7, "checkpoint.interval": 0}


def learnable_overrides(tmp: Path, **settings) -> list[str]:
    """LEARNABLE_RUN on ``phrase_tokens``, with ``settings`` (dotted keys) on top."""
    return run_overrides(tmp, {**LEARNABLE_RUN, **settings}, tokens=phrase_tokens(tmp / "tokens.npy"))


def train_rank(rank, world, overrides, tp, dp):
    """One rank of ``seqpar.train.train`` on a tp x dp mesh (for ``spawn``)."""
    from seqpar import init_parallel
    from seqpar.config import load_run_config
    from seqpar.train import train
    layout = [f"parallel.tp={tp}", f"parallel.dp={dp}"]  # the mesh's layout (Trainer refuses a contradiction)
    return train(load_run_config(None, overrides + layout), mesh=init_parallel(tp=tp, dp=dp))


def wait_for(cond, proc, log: Path, what: str, timeout: float = 300) -> None:
    """Poll ``cond()`` while ``proc`` (a launched run writing ``log``) lives; kill it and fail with the
    log's tail when it exits first or ``timeout`` seconds pass."""
    t0 = time.time()
    while not cond():
        if proc.poll() is not None or time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"{what} did not happen:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def cli_here(args: list[str], capsys) -> subprocess.CompletedProcess:
    """``seqpar ARGS`` through the console script's function in this process (no interpreter to
    start): its exit code and what it printed, as ``subprocess.run`` would return them."""
    from seqpar.cli import main
    capsys.readouterr()
    code = main(args)
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["seqpar", *args], code, out.out, out.err)
