"""Context parallelism in the tools: ``seqpar memory --cp N`` and the planner's cp search."""
from __future__ import annotations

import re

from seqpar.cli import main
from seqpar.config import load_run_config
from seqpar.memory.whole_model import model_activation_bytes


def test_memory_cli_prints_per_rank_bytes_with_cp(capsys):
    assert main(["memory", "tiny-cpu", "--cp", "2"]) == 0
    out = capsys.readouterr().out
    assert "s/cp=64 per CP rank" in out
    rows = dict(re.findall(r"^\| (none|selective|full) \| .*? \| ([0-9.]+) \|$", out, re.M))
    assert float(rows["full"]) == 0.5  # linear in s: half per rank
    assert 0.5 < float(rows["selective"]) <= 0.505  # plus the CP kernel's small log-sum-exp
    # without recompute cp=1 keeps the s x s scores; the CP kernel never does: better than half
    assert float(rows["none"]) < 0.45
    none = load_run_config("tiny-cpu", ["model.recompute=none"]).model
    one, two = (model_activation_bytes(none, t=2, micro_batch=8, cp=c)["total"] for c in (1, 2))
    assert abs(two / one - float(rows["none"])) < 1e-3


def test_memory_cli_refuses_a_cp_the_sequence_does_not_split_into(capsys):
    assert main(["memory", "tiny-cpu", "--cp", "3"]) == 2
    assert "sequence length 128 is not divisible by 2 x cp = 6" in capsys.readouterr().err


def _llama3_8b_128k():
    from seqpar.plan.gpus import GPUS
    from seqpar.plan.search import Problem
    model = load_run_config("llama3-8b", ["model.seq_len=131072"]).model
    return Problem(model, gpus=64, gpu=GPUS["h100-sxm"], global_batch=512)


def test_planner_searches_cp_for_128k_tokens():
    from seqpar.plan.layout import Layout, Recompute
    from seqpar.plan.memory import STATE_PARTS
    from seqpar.plan.search import SearchSpace, evaluate, search
    problem = _llama3_8b_128k()
    ranked = search(problem, k=10_000).ranked
    best = ranked[0]
    # the recommendation splits the sequence and leaves the headroom (5% of the GPU) free
    assert best.layout.cp > 1 and best.memory.fits and best.memory.total <= 0.95 * problem.gpu.hbm_bytes
    # fsdp x cp and pp x cp are searched: no cp layout has to carry ddp's 37 GiB of replicated state
    assert any(c.layout.cp > 1 and c.layout.data_parallel == "fsdp" for c in ranked[:10])
    assert any(c.layout.cp > 1 and c.layout.pp > 1 and c.layout.cp_comm == "allgather" for c in ranked)
    assert sum(best.memory.parts[k] for k in STATE_PARTS) < 16 * 2**30
    # no cp=1 layout fits with the headroom unless it recomputes every layer in full, and those are slower
    one = search(problem, SearchSpace(cp=(1,)), k=10_000).ranked
    assert one and all(c.layout.recompute.kind == "full" for c in one)
    assert not search(problem, SearchSpace(cp=(1,), recompute=("none", "selective")), k=10_000).ranked
    assert best.time.seconds < 0.85 * one[0].time.seconds
    # what ranked first before: t=8 x p=8 at 79.62 of 79.65 GiB, inside the allowance but not the headroom
    tight = evaluate(problem, Layout(tp=8, pp=8, dp=1, recompute=Recompute("none")))
    assert tight.memory.total <= problem.gpu.hbm_bytes and not tight.memory.fits
    assert "headroom" in tight.memory.overflow()


def test_plan_and_memory_take_key_value_overrides(capsys):
    argv = ["plan", "llama3-8b", "model.seq_len=131072", "--gpus", "64", "--gpu", "h100-sxm", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(5% kept free: 75.7 GiB planned)" in out and "refuses" not in out
    train = next(line for line in out.splitlines() if line.startswith("seqpar train "))
    assert train.startswith("seqpar train llama3-8b model.seq_len=131072 ") and "parallel.cp=" in train
    assert main(["memory", "llama3-8b", "model.seq_len=131072", "--cp", "8"]) == 0
    assert "s=131072 (s/cp=16384 per CP rank)" in capsys.readouterr().out
    assert main(["plan", "llama3-8b", "model.seq_lenx=1", "--gpus", "64", "--gpu", "h100-sxm"]) == 2
    assert "unknown key 'model.seq_lenx'" in capsys.readouterr().err
    assert main(["memory", "llama3-8b", "modle.seq_len=1"]) == 2
    assert "unknown key 'modle'" in capsys.readouterr().err


def test_planner_cp_memory_is_the_formula_the_ledger_measures():
    from seqpar.plan.layout import Layout, Recompute
    from seqpar.plan.memory import memory_per_gpu
    for mode in ("none", "selective", "full"):
        cfg = load_run_config(None, ["model.seq_len=64", "model.hidden=128", "model.heads=4", "model.layers=2",
                                     "model.vocab_size=64", "model.dropout=0", "model.attention_dropout=0",
                                     f"model.recompute={mode}"]).model
        layout = Layout(tp=2, pp=1, dp=1, micro_batch=2, recompute=Recompute(mode), cp=2)
        parts = memory_per_gpu(cfg, layout, 2**40, global_batch=2, precision="fp32").parts
        formula = model_activation_bytes(cfg, t=2, micro_batch=2, activation_bytes=4, cp=2)
        # what tests/test_context_model.py measures with the ledger within 3% of the same formula
        assert abs(parts["activations"] + parts["outside_layers"] - formula["total"]) <= 1, mode


def test_a_cp_layout_becomes_trainable_overrides(capsys):
    from seqpar.plan.layout import Layout, Recompute
    from seqpar.plan.report import check_overrides, overrides
    layout = Layout(tp=8, pp=1, dp=1, micro_batch=1, recompute=Recompute("none"), cp=8)
    items, _ = overrides(layout, _llama3_8b_128k().model, 512, "bf16")
    assert "parallel.cp=8" in items and "parallel.cp_comm=ring" in items
    assert check_overrides("llama3-8b", ["model.seq_len=131072", *items]) is None
    assert main(["plan", "llama3-8b", "--gpus", "64", "--gpu", "h100-sxm", "--layout", "tp=8,cp=8,recompute=none"]) == 0
    assert "t=8 p=1 m=1 dp=1 cp=8 b=1" in capsys.readouterr().out
    # pipeline stages exchange K/V by all-gather: the overrides say so, and seqpar train takes them
    piped = Layout(tp=2, pp=2, dp=1, virtual_stages=2, micro_batch=1, recompute=Recompute("none"), cp=16)
    items, _ = overrides(piped, _llama3_8b_128k().model, 512, "bf16")
    assert "parallel.cp_comm=allgather" in items
    assert check_overrides("llama3-8b", ["model.seq_len=131072", *items]) is None
    sharded = Layout(tp=8, pp=1, dp=1, micro_batch=1, recompute=Recompute("none"), data_parallel="fsdp", cp=8)
    items, _ = overrides(sharded, _llama3_8b_128k().model, 512, "bf16")
    assert "parallel.data_parallel=fsdp" in items and sharded.label().startswith("t=8 p=1 m=1 dp=1(fsdp) cp=8")
    assert check_overrides("llama3-8b", ["model.seq_len=131072", *items]) is None


def test_planner_times_one_gradient_reduction_over_dp_x_cp():
    """As the Trainer now runs it: one fp32 all-reduce over the dp x cp ranks (not one over cp and
    another over dp); pipeline stages issue it after the schedule, so none of it is hidden."""
    from seqpar.memory.params import stage_params
    from seqpar.plan.gpus import GPUS
    from seqpar.plan.kernels import all_reduce_seconds, link_bandwidth
    from seqpar.plan.layout import Layout, Recompute
    from seqpar.plan.timing import step_time
    model, gpu = _llama3_8b_128k().model, GPUS["h100-sxm"]
    layout = Layout(tp=4, pp=2, dp=2, micro_batch=1, recompute=Recompute("none"), cp=4)  # 64 GPUs
    params = max(stage_params(model, t=4, pp=2, stage=r) for r in (0, 1))
    once = all_reduce_seconds(4 * params, 2 * 4, link_bandwidth(gpu, intra_node=False))
    assert step_time(model, layout, gpu, 512).parts["data_parallel"] == once
