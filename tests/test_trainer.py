"""The Trainer's methods on their own: train_step, evaluate, save/resume, agree; the throughput window."""
import math

import numpy as np
import pytest
import torch

from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.train import StepMetrics, Trainer
from seqpar.train.metrics import Throughput
from seqpar.train.optim import lr_at


def _overrides(tmp) -> list[str]:
    tokens = np.random.default_rng(0).integers(0, 64, size=6000).astype(np.uint16)
    np.save(tmp / "tokens.npy", tokens)
    cfg = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 1,
           "model.dropout": 0.1, "model.attention_dropout": 0.1, "model.sequence_parallel": True,
           "model.recompute": "selective", "parallel.tp": 2, "train.steps": 10, "train.micro_batch": 2,
           "train.global_batch": 4, "train.warmup_steps": 2, "train.eval_interval": 100, "train.eval_batches": 1,
           "train.seed": 3, "data.source": str(tmp / "tokens.npy"), "checkpoint.dir": str(tmp / "ckpt"),
           "checkpoint.resume": "auto", "out_dir": str(tmp / "out")}
    return [f"{k}={v}" for k, v in cfg.items()]


def _exercise(rank, world, overrides):
    trainer = Trainer(load_run_config(None, overrides), mesh=init_parallel(tp=2))
    out = {}
    try:
        out["fresh_start"] = trainer.resume()  # no checkpoint yet
        out["steps"] = [trainer.train_step(0), trainer.train_step(1)]
        before = [p.detach().clone() for p in trainer.model.parameters()]
        out["eval"] = trainer.evaluate()
        out["eval_left_model_alone"] = trainer.model.training and all(
            torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
        out["saved"] = trainer.save(2).name
        after_save = trainer.train_step(2)
        out["resumed_at"] = trainer.resume()
        out["step2"] = (after_save, trainer.train_step(2))
        out["agree"] = trainer.agree(torch.tensor(float(rank + 1), dtype=torch.float64), stop=rank == 1)
        with torch.no_grad():
            next(trainer.model.parameters()).fill_(float("nan"))
        try:
            trainer.train_step(3)
            out["nan"] = None
        except FloatingPointError as e:
            out["nan"] = str(e)
    finally:
        trainer.close()
    return out


def test_trainer_methods(spawn, tmp_path):
    r0, r1 = spawn(_exercise, 2, _overrides(tmp_path))
    assert r0 == r1, "every method's result is identical on all ranks"
    assert r0["fresh_start"] == 0
    for step, m in enumerate(r0["steps"]):
        assert isinstance(m, StepMetrics) and not m.stop
        assert m.lr == lr_at(step, lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=10)
        assert math.isfinite(m.loss) and m.grad_norm > 0
    assert math.isfinite(r0["eval"]) and r0["eval_left_model_alone"]
    assert r0["saved"] == "step_00000002" and r0["resumed_at"] == 2
    first, again = r0["step2"]
    assert (again.loss, again.grad_norm) == (first.loss, first.grad_norm), "resume() then step 2 is bit-exact"
    assert r0["agree"] == (1.5, True), "mean loss over the world; one rank's stop stops all"
    assert r0["nan"] and "non-finite loss" in r0["nan"] and "step 4" in r0["nan"]


def test_throughput_window_means_the_steps_since_the_last_report():
    tp = Throughput(tokens_per_step=1000, flops_per_step=4e12, world_size=2, peak_flops=4e12)
    tp.add(1.0)
    tp.add(3.0)
    assert tp.report() == {"tokens/s": 500, "TFLOP/s": pytest.approx(1.0), "MFU": pytest.approx(0.25)}
    tp.add(0.5)
    assert tp.report()["tokens/s"] == 2000
    assert tp.report() == {"tokens/s": None, "TFLOP/s": None, "MFU": None}  # nothing counted
    unknown_peak = Throughput(1, 1.0, 1, None)
    unknown_peak.add(1.0)
    assert unknown_peak.report()["MFU"] is None
