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
