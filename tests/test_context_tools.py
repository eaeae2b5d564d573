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
    from seqpar.plan.search import SearchSpace, search
    problem = _llama3_8b_128k()
    cp_layouts = [c for c in search(problem, k=10_000).ranked if c.layout.cp > 1]
    assert cp_layouts and all(c.memory.fits for c in cp_layouts)
    best = cp_layouts[0]
    assert best.memory.total < 80 * 2**30 and best.layout.pp == 1
    # without cp or pipeline stages only full recompute over FSDP fits, and it is slower than cp
    flat = [c for c in search(problem, SearchSpace(cp=(1,)), k=10_000).ranked if c.layout.pp == 1]
    assert all(c.layout.recompute.kind == "full" for c in flat)
    assert best.time.seconds < flat[0].time.seconds


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
