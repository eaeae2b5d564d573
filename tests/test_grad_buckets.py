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


# context parallelism: each CP rank's gradient is its tokens' share; one bucketed reduction over dp x cp
# during backward sums the shares over cp and averages over dp (the bf16 recipe's buckets, or torch
# DDP with a communication hook in fp32)
CP_LAYOUTS = {"dp2cp2-bf16": (2, 2, "bf16"), "dp2cp2-fp32": (2, 2, "fp32"), "cp4-fp32": (1, 4, "fp32")}


def _run_cp(rank, world, tmp):
    out = {}
    for name, (dp, cp, precision) in CP_LAYOUTS.items():
        if world == 1 and name != f"dp2cp2-{precision}":
            continue  # one process: the reference of each precision
        settings = {**SETTINGS, "train.precision": precision, "parallel.cp": cp if world > 1 else 1}
        cfg = load_run_config(None, run_overrides(tmp, settings, tokens=tmp / "tokens.npy", out=f"{name}{world}"))
        trainer = Trainer(cfg, mesh=init_parallel(tp=1, dp=dp, cp=cp) if world > 1 else init_parallel(tp=1, dp=1))
        calls, original = [], dist.all_reduce

        def spy(tensor, *args, group=None, **kwargs):  # size, group size, and whether backward is running
            calls.append((tensor.numel(), dist.get_world_size(group), torch._C._current_graph_task_id() != -1))
            return original(tensor, *args, group=group, **kwargs)
        try:
            dist.all_reduce = spy
            losses, per_step = [], []
            for step in range(3):
                calls.clear()
                losses.append(trainer.train_step(step).loss)
                per_step.append(list(calls))
        finally:
            dist.all_reduce = original
            params = sum(p.numel() for p in trainer.model.parameters())
            trainer.close()
        out[name if world > 1 else precision] = {"losses": losses, "calls": per_step, "params": params}
    if world > 1:
        out["pipeline"] = _pipeline_finish_grads(init_parallel(tp=1, dp=2, cp=2))
    return out


def _pipeline_finish_grads(mesh):
    """Pipeline stages' gradient reduction on a dp=2 x cp=2 mesh: rank r's gradients are r + 1."""
    from types import SimpleNamespace
    from seqpar.parallel.pipeline import PipelineParallel
    module = torch.nn.Linear(4, 4)
    for p in module.parameters():
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    stage = SimpleNamespace(mesh=mesh, module=module, tied_parameters=list, tied_group=None, reduce_dp=True,
                            parameters=lambda: list(module.parameters()))
    calls, original = [], dist.all_reduce

    def spy(tensor, *args, group=None, **kwargs):
        calls.append(dist.get_world_size(group))
        return original(tensor, *args, group=group, **kwargs)
    try:
        dist.all_reduce = spy
        PipelineParallel.finish_grads(stage)
    finally:
        dist.all_reduce = original
    return {"calls": calls, "grads": sorted({float(v) for p in module.parameters() for v in p.grad.flatten()})}


def test_cp_gradients_reduced_once_over_dp_x_cp_in_buckets_during_backward(spawn, tmp_path):
    random_tokens(tmp_path / "tokens.npy", size=4000)
    one = spawn(_run_cp, 1, tmp_path)[0]
    for r in spawn(_run_cp, 4, tmp_path):
        for name, (dp, cp, precision) in CP_LAYOUTS.items():
            got = r[name]
            rtol = 1e-5 if precision == "fp32" else 1e-4  # bf16 matmuls round differently on s/cp tokens
            np.testing.assert_allclose(got["losses"], one[precision]["losses"], rtol=rtol, atol=0, err_msg=name)
            for step, calls in enumerate(got["calls"]):
                grads = [c for c in calls if c[0] > 8]  # not the loss, token-count and norm scalars
                assert all(g == dp * cp for _, g, _ in grads), (name, "one reduction, over dp x cp", grads)
                assert sum(n for n, _, _ in grads) == got["params"], (name, "every gradient reduced once", grads)
                assert all(inside for _, _, inside in grads), (name, "launched while backward runs", grads)
                if step > 0 or precision == "bf16":  # torch DDP rebuilds its buckets after its first step
                    assert len(grads) >= 3 and all(n < got["params"] for n, _, _ in grads), (name, "buckets", grads)
        # pipeline stages reduce after the schedule: one all-reduce over dp x cp, (1 + 2 + 3 + 4) / dp
        assert r["pipeline"] == {"calls": [4], "grads": [5.0]}, r["pipeline"]
