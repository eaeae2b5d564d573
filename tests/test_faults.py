"""Bad values are refused where they enter, naming the offending value; faults during training
(SIGTERM on one rank, non-finite gradients or weights) are handled by every rank together."""
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import signal

import pytest
import torch

from seqpar.layers import vocab_parallel_cross_entropy
from seqpar.model import GPT, GPTConfig


@pytest.mark.parametrize("bad", [300, 60000, -1, -7])
def test_cross_entropy_refuses_labels_outside_the_vocabulary(bad):
    logits = torch.randn(2, 3, 300)
    targets = torch.tensor([[1, 2, bad], [-100, 299, 0]])
    with pytest.raises(ValueError, match=rf"target id {bad} is outside the vocabulary \[0, 300\)"):
        vocab_parallel_cross_entropy(logits, targets, tp_group=None)
    targets[0, 2] = -100  # ignored positions and the edges of the vocabulary are fine
    loss = vocab_parallel_cross_entropy(logits, targets, tp_group=None)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), targets.reshape(-1))
    torch.testing.assert_close(loss, ref)


def test_gpt_loss_refuses_labels_outside_the_vocabulary():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1))
    tokens = torch.zeros(1, 8, dtype=torch.long)
    labels = torch.full((1, 8), 5)
    labels[0, 3] = 32
    with pytest.raises(ValueError, match=r"target id 32 .*\[0, 32\)"):
        model(tokens, labels)


# ---- faults during training: SIGTERM on one rank, non-finite gradients, non-finite weights ---------

def _fault_overrides(tmp, **kw) -> list[str]:
    cfg = {"model.vocab_size": 300, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 1,
           "model.dropout": 0.0, "model.attention_dropout": 0.0, "model.recompute": "none", "parallel.tp": 2,
           "train.steps": 50, "train.micro_batch": 2, "train.log_interval": 1, "train.eval_interval": 0,
           "data.source": str(tmp / "text"), "data.cache_dir": str(tmp / "cache"),
           "checkpoint.dir": str(tmp / "ckpt"), "checkpoint.interval": 0, "checkpoint.resume": "never",
           "out_dir": str(tmp / "out"), **kw}
    return [f"{k}={v}" for k, v in cfg.items()]


def _sigterm_one_rank(trainer, rank):
    """Rank 1 alone receives SIGTERM just before step 3; rank 0 never does."""
    if rank != 1:
        return
    run_step = trainer.train_step

    def train_step(step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return run_step(step)

    trainer.train_step = train_step


def _faults(rank, world, tmp):
    from seqpar import init_parallel
    from seqpar.config import load_run_config
    from seqpar.train import Trainer
    mesh, out = init_parallel(tp=2), {}
    trainer = Trainer(load_run_config(None, _fault_overrides(tmp)), mesh=mesh)
    _sigterm_one_rank(trainer, rank)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out["sigterm"] = trainer.fit()
    out["printed"] = printed.getvalue()

    second = {"out_dir": str(tmp / "out2"), "checkpoint.dir": str(tmp / "ckpt2")}
    trainer = Trainer(load_run_config(None, _fault_overrides(tmp, **second)), mesh=mesh)
    params = list(trainer.model.parameters())
    try:
        trainer.train_step(0)
        before = [p.detach().clone() for p in params]
        poison = params[-1].register_hook(lambda g: torch.full_like(g, float("nan")) if rank == 1 else g)
        try:
            trainer.train_step(1)
        except FloatingPointError as e:
            out["stop"] = str(e)
        out["stop_kept_weights"] = all(torch.equal(a, p) for a, p in zip(before, params))
        cfg = trainer.run.cfg  # the resolved run is read-only: a copy with the other setting
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, nonfinite_grads="skip"))
        trainer.run = dataclasses.replace(trainer.run, cfg=cfg)
        m = trainer.train_step(1)
        out["skip"] = (m.skipped, math.isnan(m.grad_norm), trainer.history["skipped"])
        out["skip_kept_weights"] = all(torch.equal(a, p) for a, p in zip(before, params))
        out["grads_dropped"] = all(p.grad is None for p in params)
        trainer.log_step(2, m, 0.1)
        poison.remove()
        out["next_step_trains"] = not trainer.train_step(2).skipped and not torch.equal(before[0], params[0])
        if rank == 1:
            with torch.no_grad():
                params[0].view(-1)[3] = float("inf")
        try:
            trainer.checkpoints.save(3)
        except FloatingPointError as e:
            out["save"] = str(e)
    finally:
        trainer.close()
    return out


def test_faults_during_training(spawn, tmp_path):
    words = "def return value for item in range if else print self".split()
    (tmp_path / "text").mkdir()
    rng = random.Random(0)
    (tmp_path / "text" / "code.py").write_text("\n".join(" ".join(rng.choice(words) for _ in range(8))
                                                         for _ in range(300)))
    r0, r1 = spawn(_faults, 2, tmp_path)

    # SIGTERM on one rank: both agree through the all-reduced flag, save once, exit without sampling
    for r in (r0, r1):
        assert r["sigterm"]["steps"] == [1, 2, 3], "both ranks stop after the step that saw the signal"
        assert r["sigterm"]["checkpoint"].endswith("step_00000003")
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")] == ["step_00000003"]
    assert "SIGTERM received: checkpoint written at step 3" in r0["printed"] and "sample:" not in r0["printed"]

    # non-finite gradients on one rank: every rank stops (naming the step) or skips, weights untouched
    for r in (r0, r1):
        assert "non-finite gradients" in r["stop"] and "at step 2" in r["stop"] and r["stop_kept_weights"]
        assert r["skip"] == (True, True, [2]) and r["skip_kept_weights"] and r["grads_dropped"]
        assert r["next_step_trains"]
    records = [json.loads(line) for line in (tmp_path / "out2" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and records[-1]["skipped steps"] == 1

    # weights holding inf on one rank: no rank writes a checkpoint
    assert "refusing to checkpoint step 3" in r0["save"] and "on another rank" in r0["save"]
    assert "refusing to checkpoint step 3" in r1["save"] and "here: " in r1["save"]
    assert not list((tmp_path / "ckpt2").glob("step_*")), "nothing written, not even a temporary folder"
