"""The launcher: ``torchrun -m seqpar.train tiny-cpu`` (NCCL on a GPU, gloo on the CPU) for 10
steps with dropout and eval, then a resume from its checkpoint to 12 steps."""
import json
import re
from pathlib import Path

from run_helpers import random_tokens

from .helpers import torchrun


def launcher_overrides(tmp: Path, model: list[str]) -> list[str]:
    """``tiny-cpu`` on one rank: small batches, dropout, bf16, eval and checkpoints every 5 steps, a
    local token file (nothing downloaded), all under ``tmp``; ``model`` shrinks it for the CPU."""
    tokens = random_tokens(tmp / "tokens.npy", vocab=2048, size=200_000)
    return ["parallel.tp=1", "train.micro_batch=2", "model.dropout=0.1", "model.attention_dropout=0.1",
            "train.log_interval=5", "train.eval_interval=5", "train.eval_batches=2", "checkpoint.interval=5",
            "train.precision=bf16", f"checkpoint.dir={tmp / 'ckpt'}", f"out_dir={tmp / 'out'}",
            f"data.source={tokens}", *model]


def launcher_run(tmp: Path, device: str, args: list[str], shapes) -> tuple:
    """One torchrun and what it logged: its train and eval steps (``metrics.jsonl``, and eval lines
    on stdout) and whether every loss was finite."""
    metrics = tmp / "out" / "metrics.jsonl"
    seen = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    proc = torchrun(1, ["-m", "seqpar.train", "tiny-cpu", *launcher_overrides(tmp, shapes.launcher_model), *args],
                    device, tmp, shapes.timeout_s)
    records = [json.loads(line) for line in metrics.read_text().splitlines()[seen:]] if metrics.exists() else []
    train = [r for r in records if "loss" in r]
    evals = {r["step"] for r in records if "eval loss" in r}
    evals |= {int(step) for step in re.findall(r"eval loss \S+ at step (\d+)", proc.stdout)}
    finite = all(abs(r["loss"]) < 1e4 for r in train)  # False for nan and inf too
    return proc, {"steps": [r["step"] for r in train], "evals": sorted(evals), "finite": finite}


def test_launcher(device, shapes, record_row, tmp_path):
    backend = "NCCL" if device == "cuda" else "gloo"
    first, log1 = launcher_run(tmp_path, device, ["train.steps=10", "checkpoint.resume=never"], shapes)
    on_device = f"device={device}" in first.stdout
    ok1 = (first.returncode == 0 and log1["steps"] == [5, 10] and log1["evals"] == [5, 10] and log1["finite"]
           and on_device)
    record_row(f"launcher ({backend}): 10 steps, dropout, eval",
               f"exit {first.returncode}, logged steps {log1['steps']}, eval at {log1['evals']}, finite loss "
               f"{log1['finite']}, mesh on {device}: {on_device}", "exit 0, steps [5, 10], eval at [5, 10]", ok1)
    assert ok1, f"first run, last lines of its output:\n{first.stdout[-4000:]}"
    second, log2 = launcher_run(tmp_path, device, ["train.steps=12", "checkpoint.resume=auto"], shapes)
    resumed = re.search(r"resumed from \S+ at step (\d+)", second.stdout)
    at = int(resumed.group(1)) if resumed else None
    ok2 = second.returncode == 0 and at == 10 and log2["steps"] == [12] and log2["finite"]
    record_row(f"launcher ({backend}): resume to 12 steps",
               f"exit {second.returncode}, resumed at step {at}, logged steps {log2['steps']}",
               "exit 0, resumed at 10, steps [12]", ok2)
    assert ok2, f"resumed run, last lines of its output:\n{second.stdout[-4000:]}"
