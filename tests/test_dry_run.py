"""``seqpar train --dry-run`` (issue 22): one rank of a run at the paper's scale, built and stepped on
fake tensors under a fake process group, measured next to the planner; and what fails as the
cluster would, each a one-line error naming the rank and the values."""
import json
from pathlib import Path

import pytest
import torch

import seqpar.parallel.pipeline as pipeline
import seqpar.parallel.stages as stages
from seqpar import cli
from seqpar.config import load_run_config
from seqpar.config.errors import UserError
from seqpar.tools.dryrun import FakeRun
from seqpar.tools.dryrun_report import dry_run

# a small model the failure tests build in well under a second
TINY = ["model.vocab_size=64", "model.seq_len=32", "model.hidden=32", "model.heads=4", "model.layers=4",
        "parallel.tp=2", "train.micro_batch=2", "train.global_batch=8"]


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status")


def _seqpar(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("name, world, ranks, overrides", [  # docs/dry-run.md: every layout at its full batch
    ("paper/175b", 64, [0], ["train.global_batch=8"]),         # interleaved first stage (8 micro-batches, not 64)
    ("paper/1t", 512, [504], ["train.global_batch=64"]),       # 1F1B last stage (64 micro-batches, not 512)
])
def test_paper_layouts_measure_what_the_planner_predicts_without_allocating(name, world, ranks, overrides):
    dry_run(load_run_config(None, TINY), 4, [0], device="cpu")  # the fake pg's modules imported before the baseline
    before = _rss()
    (run, r, check), = dry_run(load_run_config(name, overrides), world, ranks)
    ratios = {part: measured / planned for part, measured, planned in check.rows if measured is not None}
    for part in ("parameters", "gradients", "optimizer", "activations"):
        assert abs(ratios[part] - 1) < 0.03, (name, part, ratios[part])
    assert abs(check.peak / check.planned_peak - 1) < 0.03
    assert r.layers_built == check.layers_expected == run.cfg.model.layers // run.cfg.parallel.pp
    assert not check.problems
    # the rank holds 32-42 GiB of state; one real weight of it (>= 150 MiB) would show in the peak RSS
    assert sum(r.state.values()) > 30 * 2**30 and r.peak_rss - before < 64 * 2**20


def test_the_report_prints_a_table_and_json(capsys):
    code, out, _ = _seqpar(capsys, "train", "--dry-run", "--world", "4", "--device", "cpu", *TINY,
                           "parallel.pp=2", "--rank", "2")
    assert code == 0
    assert "rank 2 of 4 (pp 1/2, tp 0/2)" in out and "| activations |" in out and "| send | pp |" in out
    assert "tp per layer and micro-batch" in out and "peak RSS" in out
    code, out, _ = _seqpar(capsys, "train", "--dry-run", "--world", "4", "--device", "cpu", "--json", *TINY)
    doc = json.loads(out)
    assert code == 0 and [r["rank"] for r in doc["ranks"]] == [0] and doc["problems"] == []
    kinds = {(c["group"], c["kind"]) for c in doc["ranks"][0]["collectives"]}
    assert ("dp", "all_gather") in kinds and ("dp", "reduce_scatter") in kinds  # fsdp over dp = 2


def test_a_layout_error_names_the_ranks_and_values(capsys):
    code, _, err = _seqpar(capsys, "train", "paper/175b", "--dry-run", "--world", "60")
    assert code == 2 and err.count("\n") == 1
    assert "every rank of 60" in err and "60" in err and "pp x tp = 8 x 8 = 64" in err
    code, _, err = _seqpar(capsys, "train", "paper/175b", "--dry-run", "--world", "64", "--rank", "64")
    assert code == 2 and "--rank 64 is not a rank of a job of 64" in err


def test_a_shape_that_does_not_divide_names_the_values(capsys):
    code, _, err = _seqpar(capsys, "train", "paper/175b", "--dry-run", "--world", "64", "model.seq_len=2052")
    assert code == 2 and "every rank of 64" in err and "seq_len (2052" in err and "t=8" in err


def test_a_rank_that_builds_the_whole_model_fails(monkeypatch):
    def whole(config, mesh, seed, build_layers=None):  # the old bug: every layer built, the stage's kept
        return stages_gpt(config, mesh, seed=seed)
    stages_gpt = stages.GPT
    monkeypatch.setattr(stages, "GPT", whole)
    (_, r, check), = dry_run(load_run_config(None, [*TINY, "parallel.pp=2"]), 4, [2], device="cpu")
    assert r.layers_built == 4 and check.layers_expected == 2
    assert check.problems == ["rank 2 of 4 builds 4 transformer layers, but pipeline stage(s) [1] hold 2 of L=4 (p=2)"]


def test_a_missing_collective_fails(monkeypatch, capsys):
    # pipeline stages that forget to average their gradients over dp (only the clip's norm goes over dp)
    monkeypatch.setattr(pipeline, "all_reduce_coalesced", lambda tensors, group, **kwargs: None)
    code = cli.main(["train", "--dry-run", "--world", "8", "--device", "cpu", *TINY, "parallel.pp=2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1  # one line: the problems of both default ranks
    assert "rank 0 of 8 issued all_reduce of only 8 bytes over dp in one step; the layout needs at least 59,776 " \
           "bytes (the data-parallel gradient reduction)" in err
    assert "rank 4 of 8 issued all_reduce of only 8 bytes over dp" in err


def test_a_predicted_peak_above_the_gpu_memory_fails(capsys):
    # 22B's layers at t=1 on one GPU: 12 layers keep 16 bytes of state for each of 5.7e9 parameters
    code, out, err = _seqpar(capsys, "train", "paper/22b", "--dry-run", "--world", "1", "parallel.tp=1",
                             "model.layers=12", "train.micro_batch=1", "train.global_batch=1", "--gpu", "a100-80gb")
    assert code == 2 and "DOES NOT FIT" in out
    assert "rank 0 of 1 would run out of memory: predicted peak" in err and "> 80.00 GiB per GPU" in err
    assert "optimizer" in err


def test_reading_a_value_inside_the_step_names_the_line():
    with FakeRun():
        x = torch.zeros(3)
        with pytest.raises(RuntimeError, match=r"reads a tensor's value .*test_dry_run.py"):
            float(x.sum())


def test_ddp_of_torch_is_refused_with_what_works():
    cfg = load_run_config(None, [*TINY, "parallel.data_parallel=ddp", "train.precision=fp32"])
    with pytest.raises(UserError, match="rank 0 of 4: data_parallel=ddp over dp=2 in fp32 .*train.precision=bf16"):
        dry_run(cfg, 4, device="cpu")
    cfg = load_run_config(None, [*TINY, "parallel.cp=2", "model.attention_dropout=0", "parallel.data_parallel=ddp",
                                 "train.precision=fp32"])
    with pytest.raises(UserError, match="rank 0 of 4: data_parallel=ddp over dp=1 x cp=2 in fp32"):
        dry_run(cfg, 4, device="cpu")  # DDP reduces over dp x cp (before: torch's reducer failed on fake tensors)


def test_plan_verify_dry_runs_the_chosen_layout(capsys):
    code, out, _ = _seqpar(capsys, "plan", "tiny-cpu", "--gpus", "2", "--gpu", "a100-80gb", "--global-batch", "8",
                           "--layout", "tp=2,micro_batch=8", "--verify")
    assert code == 0
    assert "verify: seqpar train tiny-cpu parallel.tp=2" in out and "## dry run of tiny-cpu: rank 0 of 2" in out
