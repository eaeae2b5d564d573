"""The Trainer's methods on their own (train_step, evaluate, save/resume, agree, sample), how a step's data
is split, and the throughput window."""
import contextlib
import io
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from seqpar import init_parallel
from seqpar.distributed.mesh import ParallelMesh
from seqpar.config import load_run_config
from seqpar.train import StepMetrics, Trainer
from seqpar.train.metrics import Throughput
from seqpar.train.optim import lr_at

from run_helpers import TINY_MODEL, random_tokens, run_overrides


# two TP ranks with dropout on: the methods' results must agree across ranks all the same
RUN = {**TINY_MODEL, "model.heads": 2, "model.layers": 1, "model.dropout": 0.1, "model.attention_dropout": 0.1,
       "model.sequence_parallel": True, "model.recompute": "selective", "parallel.tp": 2, "train.steps": 10,
       "train.micro_batch": 2, "train.global_batch": 4, "train.warmup_steps": 2, "train.eval_interval": 100,
       "train.eval_batches": 1, "train.seed": 3, "checkpoint.resume": "auto"}


def _exercise(rank, world, overrides):
    trainer = Trainer(load_run_config(None, overrides), mesh=init_parallel(tp=2))
    out = {}
    try:
        out["fresh_start"] = (trainer.checkpoints.resume() or 0)  # no checkpoint yet
        out["steps"] = [trainer.train_step(0), trainer.train_step(1)]
        before = [p.detach().clone() for p in trainer.model.parameters()]
        out["eval"] = trainer.evaluate()
        out["eval_left_model_alone"] = trainer.model.training and all(
            torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
        out["saved"] = trainer.checkpoints.save(2).name
        after_save = trainer.train_step(2)
        out["resumed_at"] = (trainer.checkpoints.resume() or 0)
        out["step2"] = (after_save, trainer.train_step(2))
        out["agree"] = trainer.agree(torch.tensor(float(rank + 1), dtype=torch.float64), stop=rank == 1,
                                     grad_norm=torch.tensor(1.0 if rank == 0 else math.inf))[:3]
        out["batches"] = [(x.tolist(), y.tolist()) for x, y in trainer.micro_batches(5)]  # TP ranks: equal
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
    r0, r1 = spawn(_exercise, 2, run_overrides(tmp_path, RUN))
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
    assert r0["agree"] == (1.5, True, False), "mean loss over the world; one rank's stop or non-finite counts for all"
    assert len(r0["batches"]) == 2 and r0["batches"][0] != r0["batches"][1], "2 distinct micro-batches per step"
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


# ---- a step's data: one global batch, however it is split --------------------------------------

def _split_overrides(tmp, micro_batch: int, dp: int) -> list[str]:
    return run_overrides(tmp, {**TINY_MODEL, "model.heads": 2, "model.layers": 1, "model.dropout": 0.0,
                               "model.attention_dropout": 0.0, "model.sequence_parallel": False,
                               "model.recompute": "none", "train.steps": 5, "train.micro_batch": micro_batch,
                               "train.global_batch": 8, "train.lr": 3e-3, "train.warmup_steps": 2,
                               "train.eval_interval": 0, "train.seed": 11},
                         tokens=tmp / "tokens.npy", out=f"out-{micro_batch}x{dp}")


def _whole(grad: torch.Tensor) -> torch.Tensor:
    """This TP rank's whole gradient: FSDP's shards over dp put together (a DTensor), else a copy."""
    full = getattr(grad, "full_tensor", None)
    return (full() if callable(full) else grad).detach().clone()


def _run_splits(rank, world, tmp, micro_batches):
    """For each micro-batch size: the dense grads of step 0, then 5 steps' losses and grad norms."""
    mesh = init_parallel(tp=1, dp=world) if world > 1 else ParallelMesh.single()
    out = {}
    for micro in micro_batches:
        trainer = Trainer(load_run_config(None, _split_overrides(tmp, micro, world)), mesh=mesh)
        try:
            trainer.engine.forward_backward(trainer.micro_batches(0))
            grads = {n: _whole(p.grad).numpy() for n, p in trainer.model.named_parameters()}
            trainer.optimizer.zero_grad(set_to_none=True)
            steps = [trainer.train_step(s) for s in range(5)]
        finally:
            trainer.close()
        out[micro] = {"grads": grads, "losses": [m.loss for m in steps], "norms": [m.grad_norm for m in steps],
                      "accum": trainer.run.accum}
    return out


def test_a_step_trains_on_its_global_batch_however_it_is_split(spawn, tmp_path):
    """micro_batch x accumulation x dp in {8x1x1, 4x2x1, 2x2x2, 1x4x2}: same grads, grad norms and losses.
    The grads after k accumulated micro-batches equal one full-batch pass (loss scaled by 1/k)."""
    random_tokens(tmp_path / "tokens.npy", size=4000, seed=1)
    one = _run_splits(0, 1, tmp_path, (8, 4))
    two = spawn(_run_splits, 2, tmp_path, (2, 1))
    runs = {"8x1x1": one[8], "4x2x1": one[4], "2x2x2": two[0][2], "1x4x2": two[0][1], "1x4x2 rank 1": two[1][1]}
    assert [r["accum"] for r in runs.values()] == [1, 2, 2, 4, 4]
    ref = runs["8x1x1"]
    for name, run in runs.items():
        np.testing.assert_allclose(run["losses"], ref["losses"], rtol=0, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(run["norms"], ref["norms"], rtol=1e-5, err_msg=name)
        for param, g in ref["grads"].items():
            np.testing.assert_allclose(run["grads"][param], g, rtol=1e-5, atol=1e-7, err_msg=f"{name} {param}")
    assert len(set(ref["losses"])) == 5


# ---- evaluate, sample, metrics, the tokenizer in checkpoints -----------------------------------

WORDS = ["def", "return", "value", "for", "item", "in", "range", "(", ")", ":", "if", "else", "print", "self"]
OTHER_WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "quam"]


def _text_corpus(root: Path, words: list[str]) -> Path:
    rng = random.Random(0)
    root.mkdir(parents=True)
    for i in range(3):
        lines = (" ".join(rng.choice(words) for _ in range(8)) for _ in range(150))
        (root / f"part{i}.py").write_text("\n".join(lines) + "\n")
    return root


def _text_overrides(tmp: Path, source: Path, out: Path) -> list[str]:
    cfg = {"model.vocab_size": 300, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 1,
           "model.dropout": 0.0, "model.attention_dropout": 0.0, "parallel.tp": 2, "train.steps": 4,
           "train.micro_batch": 2, "train.log_interval": 2, "train.eval_interval": 2, "train.eval_batches": 1,
           "data.source": str(source), "data.cache_dir": str(tmp / f"cache-{source.name}"),
           "data.eval_fraction": 0.1, "checkpoint.dir": str(tmp / "text" / "ckpt"), "checkpoint.interval": 0,
           "checkpoint.resume": "auto", "out_dir": str(out)}
    return [f"{k}={v}" for k, v in cfg.items()]


def _fit_then_resume_other_corpus(rank, world, tmp):
    mesh = init_parallel(tp=2)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = Trainer(load_run_config(None, _text_overrides(tmp, tmp / "text", tmp / "text" / "runs")),
                          mesh=mesh).fit()
    other = Trainer(load_run_config(None, _text_overrides(tmp, tmp / "other", tmp / "runs-other")), mesh=mesh)
    try:
        other.checkpoints.resume()
        refused = None
    except ValueError as e:
        refused = str(e)
    finally:
        other.close()
    return history, printed.getvalue(), refused


def test_fit_evaluates_samples_logs_and_checkpoints_its_tokenizer(spawn, tmp_path, capsys):
    from seqpar.cli import main
    from seqpar.data import prepare_corpus
    _text_corpus(tmp_path / "text", WORDS)
    _text_corpus(tmp_path / "other", OTHER_WORDS)
    (h0, out0, refused0), (h1, out1, refused1) = spawn(_fit_then_resume_other_corpus, 2, tmp_path)
    assert [step for step, _ in h0["eval"]] == [2, 4] and all(math.isfinite(v) for _, v in h0["eval"])
    assert h0["eval"] == h1["eval"] and h0["losses"] == h1["losses"]
    assert "eval loss" in out0 and "\nsample:\n" in out0 and out1 == "", "rank 0 prints, with a sample"
    records = [json.loads(line) for line in (tmp_path / "text" / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [2, 4]
    assert all({"lr", "grad norm", "tokens/s"} <= set(r) for r in records if "loss" in r)
    assert [(r["step"], r["eval loss"]) for r in records if "eval loss" in r] == h0["eval"]
    # the run's folders inside the source were not corpus: the same fingerprint, one cache folder
    ckpt, cache = Path(h0["checkpoint"]), tmp_path / "cache-text"
    corpus = prepare_corpus(tmp_path / "text", vocab_size=300, cache_dir=cache, log=lambda s: None,
                            exclude=(tmp_path / "text" / "runs", tmp_path / "text" / "ckpt"))
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    assert out0.split("\nsample:\n", 1)[1].startswith(corpus.opening())  # the sample starts from the data
    # the checkpoint carries the corpus's tokenizer; a corpus with another tokenizer cannot resume it
    assert json.loads((ckpt / "tokenizer.json").read_text()) == json.loads(corpus.tokenizer.to_str())
    assert refused0 == refused1 and "different tokenizer" in refused0 and str(ckpt) in refused0
    # `seqpar generate` reads the checkpoint alone: weights, config and tokenizer
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "text" / "ckpt"), "--prompt", "def ", "--tokens", "6", "--seed", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(corpus.encode(text)) > len(corpus.encode("def "))


# ---- a long corpus build on one rank does not time out the others --------------------------------

BUILD_S, COLLECTIVE_TIMEOUT_S = 8.0, 3.0


def _slow_corpus_build(rank, world, overrides):
    import time

    from seqpar.data import cache as corpus_cache
    train_tokenizer = corpus_cache._train_tokenizer

    def slow(*args, **kwargs):  # stands for hours of tokenizing a large corpus
        time.sleep(BUILD_S)
        return train_tokenizer(*args, **kwargs)

    corpus_cache._train_tokenizer = slow
    trainer = Trainer(load_run_config(None, overrides), mesh=init_parallel(tp=2))
    try:
        return trainer.agree(torch.tensor(1.0, dtype=torch.float64), stop=False)  # a collective after it
    finally:
        trainer.close()


def test_a_long_corpus_build_does_not_time_out_the_other_ranks(tmp_path):
    """The process group's timeout (here 3 s, run_local called directly to set it) is shorter than
    the build (8 s): the waiting rank waits on the cache's file lock, not in a collective."""
    from seqpar.distributed.local import run_local
    _text_corpus(tmp_path / "text", WORDS)
    overrides = _text_overrides(tmp_path, tmp_path / "text", tmp_path / "runs")
    results = run_local(_slow_corpus_build, 2, overrides, timeout=300, collective_timeout=COLLECTIVE_TIMEOUT_S,
                        tmp_dir=tmp_path)
    assert [r[:3] for r in results] == [(1.0, False, True)] * 2
