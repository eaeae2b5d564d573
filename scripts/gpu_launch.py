"""The torchrun side of scripts/gpu_validate.py: starting ranks, and check 5, the launcher
(``torchrun -m seqpar.train tiny-cpu`` for 10 steps with dropout and eval, then a resume to 12)."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from gpu_common import Row, verdict
from seqpar.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def subprocess_env(device: str, tmp: Path) -> dict[str, str]:
    """Environment of a torchrun child: this checkout importable, caches in ``tmp``, no GPU on the CPU."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               SEQPAR_CACHE=str(tmp / "cache"), PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU even on a GPU machine
    return env


def torchrun(nproc: int, args: list[str], env: dict[str, str], timeout_s: int) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc ARGS``; stdout and stderr captured together."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out + f"\n(timed out after {timeout_s} s)")


def show_failure(what: str, proc: subprocess.CompletedProcess) -> None:
    print(f"--- {what} exited {proc.returncode}; last lines of its output:\n" + proc.stdout[-4000:], file=sys.stderr)


def launcher_overrides(tmp: Path) -> list[str]:
    """Overrides of ``tiny-cpu`` for check 5: one rank, small batches, dropout, eval and checkpoints
    every 5 steps, a local token file (no tokenizer training, nothing downloaded), all under ``tmp``."""
    import numpy as np
    if not (tmp / "tokens.npy").exists():
        np.save(tmp / "tokens.npy", np.random.default_rng(0).integers(0, 2048, size=200_000).astype(np.uint16))
    ov = ["parallel.tp=1", "train.micro_batch=2", "model.dropout=0.1", "model.attention_dropout=0.1",
          "train.log_interval=5", "train.eval_interval=5", "train.eval_batches=2", "checkpoint.interval=5",
          f"checkpoint.dir={tmp / 'ckpt'}", f"out_dir={tmp / 'out'}", f"data.source={tmp / 'tokens.npy'}"]
    if "precision" in {f.name for f in dataclasses.fields(TrainConfig)}:
        ov.append("train.precision=bf16")  # the paper's recipe
    return ov


def launcher_run(tmp: Path, device: str, args: list[str], timeout_s: int) -> tuple[subprocess.CompletedProcess, dict]:
    """One ``torchrun -m seqpar.train tiny-cpu`` of check 5 and what it logged: its train and eval
    steps (from ``metrics.jsonl``, or eval lines on stdout) and whether every loss was finite."""
    metrics = tmp / "out" / "metrics.jsonl"
    seen = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    proc = torchrun(1, ["-m", "seqpar.train", "tiny-cpu", *launcher_overrides(tmp), *args],
                    subprocess_env(device, tmp), timeout_s)
    records = [json.loads(line) for line in metrics.read_text().splitlines()[seen:]] if metrics.exists() else []
    train = [r for r in records if "loss" in r]
    evals = {r["step"] for r in records if "eval loss" in r}
    evals |= {int(step) for step in re.findall(r"eval loss \S+ at step (\d+)", proc.stdout)}
    finite = all(abs(r["loss"]) < 1e4 for r in train)  # False for nan and inf too
    return proc, {"steps": [r["step"] for r in train], "evals": sorted(evals), "finite": finite}


def check_launcher(device: str, timeout_s: int) -> list[Row]:
    """Check 5: ``torchrun -m seqpar.train tiny-cpu`` for 10 steps, then a resume to 12."""
    backend = "NCCL" if device == "cuda" else "gloo"
    with tempfile.TemporaryDirectory(prefix="seqpar-validate-") as d:
        tmp = Path(d)
        first, log1 = launcher_run(tmp, device, ["train.steps=10", "checkpoint.resume=never"], timeout_s)
        second, log2 = launcher_run(tmp, device, ["train.steps=12", "checkpoint.resume=auto"], timeout_s)
    on_device = f"device={'cuda' if device == 'cuda' else 'cpu'}" in first.stdout
    ok1 = (first.returncode == 0 and log1["steps"] == [5, 10] and log1["evals"] == [5, 10] and log1["finite"]
           and on_device)
    resumed = re.search(r"resumed from \S+ at step (\d+)", second.stdout)
    at = int(resumed.group(1)) if resumed else None
    ok2 = second.returncode == 0 and at == 10 and log2["steps"] == [12] and log2["finite"]
    for ok, what, proc in ((ok1, "first run", first), (ok2, "resumed run", second)):
        if not ok:
            show_failure(f"launcher {what}", proc)
    return [Row(f"launcher ({backend}): 10 steps, dropout, eval",
                f"exit {first.returncode}, logged steps {log1['steps']}, eval at {log1['evals']}, finite loss "
                f"{log1['finite']}, mesh on {device}: {on_device}", "exit 0, steps [5, 10], eval at [5, 10]",
                verdict(ok1)),
            Row(f"launcher ({backend}): resume to 12 steps",
                f"exit {second.returncode}, resumed at step {at}, logged steps {log2['steps']}",
                "exit 0, resumed at 10, steps [12]", verdict(ok2))]
