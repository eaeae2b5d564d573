"""A diverging run keeps its good checkpoints: steps skipped for NaN/inf (train.nonfinite_grads=skip)
write no checkpoint, keep-N spares the last good one, too many in a row stop the run in one line
(exit 2) naming the checkpoint to roll back to, and checkpoint.resume=PATH rolls back to it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from run_helpers import cli_here, run_overrides
from seqpar.config import load_run_config
from seqpar.distributed.mesh import ParallelMesh
from seqpar.model import GPT, GPTConfig
from seqpar.train import Trainer
from seqpar.train.faults import NonFiniteError
from seqpar.train.generate import sample

SMALL = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 1,
         "model.dropout": 0.0, "model.attention_dropout": 0.0, "train.micro_batch": 2, "train.warmup_steps": 2,
         "train.log_interval": 1, "train.eval_interval": 0, "train.precision": "fp32", "parallel.tp": 1}
# the reported run: the good run's checkpoints, then a resume at a learning rate that blows up
GOOD = {"train.steps": 10, "checkpoint.interval": 5, "checkpoint.keep": 2}
DIVERGE = {"train.steps": 40, "train.lr": 1e6, "train.warmup_steps": 0, "train.nonfinite_grads": "skip",
           "checkpoint.resume": "auto"}


def _trainer(tmp: Path, **settings) -> Trainer:
    overrides = run_overrides(tmp, {**SMALL, **GOOD, **{k.replace("__", "."): v for k, v in settings.items()}})
    return Trainer(load_run_config(None, overrides), mesh=ParallelMesh.single())


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("step_*"))


def test_a_diverging_run_keeps_its_good_checkpoints_and_rolls_back(tmp_path, capsys):
    good = _trainer(tmp_path).fit()["losses"]
    with pytest.raises(NonFiniteError) as info:
        _trainer(tmp_path, **DIVERGE).fit()
    printed = capsys.readouterr().out
    ckpt = tmp_path / "ckpt"
    message = str(info.value)
    first, last = map(int, re.search(r"steps (\d+)-(\d+) skipped in a row", message).groups())
    assert last - first == 10 and "train.max_skipped_steps=10" in message, message  # 11 in a row: one too many
    assert f"checkpoint.resume={ckpt / 'step_00000010'} " in message and "\n" not in message, message
    # no checkpoint from the blown-up weights, and keep=2 deleted neither good one
    assert _steps(ckpt) == ["step_00000005", "step_00000010"], _steps(ckpt)
    assert "checkpoint of step 15 not written: the step was skipped" in printed, printed[-2000:]

    # checkpoint.resume=PATH: that checkpoint (not the newest), the same losses as the run it was saved from
    rolled = _trainer(tmp_path, checkpoint__resume=str(ckpt / "step_00000005")).fit()
    assert rolled["steps"] == [6, 7, 8, 9, 10] and rolled["losses"] == good[5:], (rolled["losses"], good)
    # a checkpoint dir means its newest: step 10 again (just rewritten), so nothing is left to train
    assert _trainer(tmp_path, checkpoint__resume=str(ckpt)).fit()["steps"] == []


def _poison_steps(trainer: Trainer, steps: set[int]) -> None:
    """Optimizer steps ``steps`` (from 1) get NaN gradients."""
    current = {"step": 0}
    param = next(trainer.model.parameters())
    param.register_hook(lambda g: torch.full_like(g, float("nan")) if current["step"] in steps else g)
    run_step = trainer.train_step

    def train_step(step):
        current["step"] = step + 1
        return run_step(step)

    trainer.train_step = train_step


def test_keep_n_spares_the_last_good_checkpoint_while_steps_are_skipped(tmp_path, capsys):
    trainer = _trainer(tmp_path, train__steps=14, train__nonfinite_grads="skip", train__max_skipped_steps=2,
                       checkpoint__interval=2, checkpoint__keep=1)
    _poison_steps(trainer, {3, 5, 6, 11, 12, 13})
    ckpt = tmp_path / "ckpt"
    kept = []
    save = trainer.checkpoints.save

    def watched_save(step, **kwargs):
        path = save(step, **kwargs)
        kept.append((step, _steps(ckpt)))
        return path

    trainer.checkpoints.save = watched_save
    with pytest.raises(NonFiniteError, match=r"^steps 11-13 skipped in a row, more than train.max_skipped_steps=2 .*"
                       rf"checkpoint.resume={re.escape(str(ckpt / 'step_00000010'))} and a lower train.lr$"):
        trainer.fit()
    assert kept == [
        (2, ["step_00000002"]),
        (4, ["step_00000002", "step_00000004"]),  # step 3 was skipped: step 2 stays the good one
        # step 6 was skipped: no checkpoint; 7-8 trained, but 5-6 were skipped since the last one
        (8, ["step_00000002", "step_00000008"]),
        (10, ["step_00000010"]),  # 9-10 clean: step 10 is the good one, keep=1 again
    ], kept
    assert "checkpoint of step 6 not written" in capsys.readouterr().out
    assert _steps(ckpt) == ["step_00000010"]


def test_sampling_from_non_finite_weights_is_one_clear_error():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1), seed=0)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match="logits for new token 1 hold NaN/inf"):
        sample(model, [1, 2, 3], 4)


def test_checkpoint_resume_names_a_checkpoint_or_fails_in_one_line(tmp_path):
    from seqpar.checkpoint import CheckpointError, named_checkpoint
    assert load_run_config(None, [f"checkpoint.resume={tmp_path}"]).checkpoint.resume == str(tmp_path)
    with pytest.raises(ValueError, match=r"checkpoint.resume must be auto, never or a checkpoint path"):
        load_run_config(None, ["checkpoint.resume=''"])
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=.*nowhere: no such folder"):
        named_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"checkpoint.resume=.*: holds no complete checkpoint"):
        named_checkpoint(tmp_path)
    (tmp_path / "step_00000007").mkdir()
    with pytest.raises(CheckpointError, match=r"step_00000007: not a complete checkpoint \(no complete.json\)"):
        named_checkpoint(tmp_path / "step_00000007")


# ---- through the command line: one line, exit code 2 --------------------------------------------

def _train(tmp: Path, nproc: int, settings: dict, out: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    args = run_overrides(tmp, {**SMALL, **settings}, out=out)
    return subprocess.run([sys.executable, "-m", "seqpar.cli", "train", "--nproc-per-node", str(nproc), *args],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=300)


def _one_line(p: subprocess.CompletedProcess, pattern: str) -> str:
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "failed (" not in out, out[-3000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and re.fullmatch(pattern, lines[0]), p.stderr[-3000:]
    return lines[0]


def test_the_cli_stops_a_diverged_run_in_one_line(tmp_path, capsys):
    _trainer(tmp_path).fit()  # the good run's checkpoints, steps 5 and 10 (in this process: quicker)
    # one process, through the command's own function (the launcher's relay: the runs below)
    p = cli_here(["train", *run_overrides(tmp_path, {**SMALL, **GOOD, **DIVERGE}, out="diverged")], capsys)
    ckpt = tmp_path / "ckpt"
    _one_line(p, rf"seqpar train: steps \d+-\d+ skipped in a row, more than train.max_skipped_steps=10 "
                 rf".*checkpoint.resume={re.escape(str(ckpt / 'step_00000010'))} and a lower train.lr")
    assert _steps(ckpt) == ["step_00000005", "step_00000010"]
    records = [json.loads(x) for x in (tmp_path / "diverged" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 11, "the diverging run resumed from step 10"

    # train.nonfinite_grads=stop: one line naming the step, exit 2, on one rank and on two
    stop = {"train.steps": 6, "train.lr": 1e6, "train.warmup_steps": 0, "checkpoint.dir": str(tmp_path / "c2")}
    for nproc, ranks in ((1, ""), (2, "ranks 0, 1: ")):
        p = _train(tmp_path, nproc, stop, f"stop{nproc}")
        _one_line(p, rf"seqpar train: {ranks}non-finite (loss|gradients).* at step \d+; stopping before the "
                     rf"optimizer step\. .*no checkpoint was written\.")
