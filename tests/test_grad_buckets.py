"""ddp with the bf16 recipe: the fp32 gradients live in a few flat buckets (no copy into a flat
buffer), each all-reduced over dp as soon as the last backward has produced it, so the first
bucket's reduction starts before backward ends; the run equals one rank's on the same global batch."""
import numpy as np
import pytest
import torch
import torch.distributed as dist

from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.train import Trainer

from run_helpers import random_tokens, run_overrides

SETTINGS = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 2,
            "model.dropout": 0.0, "model.attention_dropout": 0.0, "model.sequence_parallel": False,
            "model.recompute": "selective", "train.steps": 3, "train.micro_batch": 2, "train.global_batch": 8,
            "train.warmup_steps": 1, "train.eval_interval": 0, "train.seed": 5, "train.precision": "bf16",
            "parallel.tp": 1, "parallel.data_parallel": "ddp", "parallel.bucket_mib": 0.01}


def _run(rank, world, tmp):
    cfg = load_run_config(None, run_overrides(tmp, SETTINGS, tokens=tmp / "tokens.npy", out=f"out{world}"))
    trainer = Trainer(cfg, mesh=init_parallel(tp=1, dp=world))
    buckets = trainer.engine.data_parallel.buckets
    calls, original = [], dist.all_reduce

    def spy(tensor, *args, **kwargs):  # which tensor, and whether backward is still running
        calls.append((tensor.data_ptr(), tensor.numel(), torch._C._current_graph_task_id() != -1))
        return original(tensor, *args, **kwargs)
    try:
        dist.all_reduce = spy
        losses = [trainer.train_step(step).loss for step in range(3)]
    finally:
        dist.all_reduce = original
        trainer.close()
    if buckets is None:
        return {"losses": losses}
    ptrs = [b.data_ptr() for b in buckets.buffers]
    total = sum(b.numel() for b in buckets.buffers)
    return {"losses": losses, "buckets": len(ptrs), "total": total,
            "bucket_calls": [c for c in calls if c[0] in ptrs], "calls": calls}


def test_bf16_ddp_reduces_gradient_buckets_during_backward(spawn, tmp_path):
    random_tokens(tmp_path / "tokens.npy", size=4000)
    one = spawn(_run, 1, tmp_path)[0]
    for r in spawn(_run, 2, tmp_path):
        assert r["buckets"] >= 3, r["buckets"]
        per_step = r["bucket_calls"][:r["buckets"]]
        assert len(r["bucket_calls"]) == 3 * r["buckets"], "each bucket reduced once per step"
        assert per_step[0][2], "the first bucket's all-reduce must start inside backward"
        assert all(n < r["total"] for _, n, _ in r["calls"]), "no all-reduce of one flat copy of every gradient"
        np.testing.assert_allclose(r["losses"], one["losses"], rtol=1e-5, atol=1e-6)
    assert len(set(one["losses"])) == 3


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match=r"parallel.bucket_mib must be a finite number > 0, got 0"):
        load_run_config(None, ["parallel.bucket_mib=0"])
