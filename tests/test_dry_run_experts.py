"""``--dry-run`` and ``seqpar plan --verify`` with a mixture of experts and expert parallelism (issue 34):
fake router ids have no values, so the dry run routes as the planner assumes (balanced: each expert
``n k / E`` rows, every ep peer alike); it measures state, activations and every collective (the
all-to-alls over ep, the experts' gradients over edp) next to the planner's figures and formulas."""
import re

import pytest
import torch

from seqpar import cli
from seqpar.config import load_run_config
from seqpar.errors import UserError
from seqpar.memory.moe import all_to_all_bytes, all_to_all_wire_bytes, expert_layer_comm
from seqpar.tools.dryrun_check import VERIFY_TOLERANCE
from seqpar.tools.dryrun_report import dry_run, report
from seqpar.tools.dryrun_routing import balanced_counts

# moe-tiny-cpu (4 layers, the first dense; 4 SwiGLU experts, top-2) on a fake world of 8: t=2 x dp=4, ep=2
EP = ["parallel.tp=2", "parallel.ep=2", "train.micro_batch=4", "train.precision=bf16"]
STATE = ("parameters", "gradients", "optimizer", "activations", "outside_layers")


def _one(overrides: list[str], world: int = 8, **kwargs):
    (run, r, check), = dry_run(load_run_config("moe-tiny-cpu", overrides), world, [0], device="cuda", **kwargs)
    return run, r, check


def test_balanced_counts_spread_the_assignments_evenly():
    assert balanced_counts(10, 4).tolist() == [3, 3, 2, 2]
    assert balanced_counts(256, 4).tolist() == [64] * 4 and balanced_counts(0, 3).tolist() == [0, 0, 0]
    assert balanced_counts(8, 4).dtype == torch.int64


@pytest.mark.parametrize("overrides", [EP, [*EP, "parallel.data_parallel=fsdp"]], ids=["ddp", "fsdp"])
def test_an_ep_dry_run_measures_what_the_planner_predicts(overrides):
    run, r, check = _one(overrides)
    ratios = {part: m / p for part, m, p in check.rows if m is not None}
    assert set(STATE) <= set(ratios)
    for part in STATE:  # the dense dry run's tolerance (tests/test_dry_run.py)
        assert abs(ratios[part] - 1) < 0.03, (part, ratios[part])
    assert abs(check.peak / check.planned_peak - 1) <= VERIFY_TOLERANCE
    assert r.coords["ep"] == (0, 2) and not check.problems
    groups = {(row["group"], row["kind"]) for row in r.comm}
    assert ("ep", "all_to_all") in groups
    edp = {("edp", "all_gather"), ("edp", "reduce_scatter")} if "fsdp" in overrides[-1] else {("edp", "all_reduce")}
    assert edp <= groups  # the experts' gradients go over their 2 edp ranks, not over dp
    assert 0 < r.experts["gradients"] < r.state["gradients"]


def test_all_to_all_bytes_per_moe_layer_equal_the_formula():
    run, r, check = _one(EP)
    cfg = run.cfg.model
    dims = dict(s=cfg.seq_len, b=4, t=2, act=2, ep=2)
    calls, nbytes = expert_layer_comm(cfg, **dims)["all_to_all"]
    one = all_to_all_bytes(cfg, **dims)
    assert (calls, nbytes) == (5, sum(one.values()) // 2) == (5, 8 * 4 + 4 * (64 * 4 // 2) * 2 * 64 * 2)
    assert check.expert_comm == {"measured": (calls, nbytes), "formula": (calls, nbytes)}
    row, = [x for x in r.comm if (x["group"], x["kind"]) == ("ep", "all_to_all")]
    moe_layers = 3  # of 4: the first is dense
    assert row["calls"] == row["layer_calls"] == calls * moe_layers * r.micro_batches
    assert row["bytes"] == row["layer_bytes"] == nbytes * moe_layers * r.micro_batches
    # one row exchange's input is the n k rows one rank routes; (ep-1)/ep of them leave it
    rows_one_call = one["forward_rows"] // (2 * 2)
    assert all_to_all_wire_bytes(cfg, **{**dims}) == rows_one_call / 2


def test_the_moe_layers_tp_collectives_equal_their_formula():
    run, r, check = _one(EP)
    measured, seqpar = check.layer_comm["measured"], check.layer_comm["seqpar"]
    assert set(measured) == set(seqpar) == {"all_gather", "all_reduce", "reduce_scatter"}
    for kind in seqpar:
        assert measured[kind] == pytest.approx(seqpar[kind], rel=1e-12), kind
    assert check.layer_wire["measured"] == pytest.approx(check.layer_wire["seqpar"], rel=1e-12)


def test_the_report_prints_the_ep_table_and_the_routing_stand_in():
    run, r, check = _one(EP)
    lines: list[str] = []
    assert report("moe-tiny-cpu", [(run, r, check)], print_=lines.append) == []
    out = lines[0]
    assert "(pp 0/1, dp 0/4, ep 0/2, tp 0/2)" in out and "| all_to_all | ep |" in out and "| all_reduce | edp |" in out
    assert re.search(r"\| measured in the MoE layers \| 5 \| [\d.]+ KiB \| 1\.000 \|", out)
    assert "routing: balanced stand-in" in out and "n k / E" in out and "every ep peer routes alike" in out
    # without ep an MoE model routes by the same stand-in (its counts are values too) and says so
    (run, r, check), = dry_run(load_run_config("moe-tiny-cpu", ["parallel.tp=2", "train.precision=bf16"]), 2,
                               device="cuda")
    lines = []
    report("moe-tiny-cpu", [(run, r, check)], print_=lines.append)
    assert "routing: balanced stand-in" in lines[0] and "ep per MoE layer" not in lines[0] and not check.problems
    assert all(abs(m / p - 1) < 0.03 for part, m, p in check.rows if m is not None and p)


def test_a_missing_all_to_all_is_a_problem(monkeypatch):
    import seqpar.distributed.expert_dispatch as dispatch
    monkeypatch.setattr(dispatch, "exchange_rows", lambda x, group, out_rows, in_rows: x)  # rows never leave
    run, r, check = _one(EP)
    assert any("issued no all_to_all over ep in one step; the layout needs at least 393,312 bytes (the MoE "
               "layers' token exchange over ep)" in p for p in check.problems), check.problems


def test_plan_verify_dry_runs_an_ep_layout(capsys):
    code = cli.main(["plan", "moe-tiny-cpu", *EP[2:], "--gpus", "8", "--gpu", "h100-sxm", "--layout",
                     "tp=2,pp=1,dp=4,ep=2,micro_batch=4,sequence_parallel=true,recompute=selective", "--verify"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "parallel.ep=2" in out and "ep per MoE layer and micro-batch" in out
    ratios = [float(m.group(1)) for m in re.finditer(r"\| (?:activations|parameters|optimizer) \| [^|]+ \| [^|]+ \| "
                                                     r"([\d.]+) \|", out)]
    assert len(ratios) == 3 and all(abs(x - 1) <= VERIFY_TOLERANCE for x in ratios), ratios


def test_pipeline_stages_with_ep_exchange_the_formulas_bytes():
    # pp=2 x ep=2 x t=2: each stage's ep group inside the stage; ranks 0 (layers 0-1) and 4 (layers 2-3)
    results = dry_run(load_run_config("moe-tiny-cpu", ["parallel.pp=2", *EP[:2], "train.micro_batch=2",
                                                       "train.precision=bf16"]), 8, device="cuda")
    assert [r.rank for _, r, _ in results] == [0, 4]
    for run, r, check in results:
        assert check.expert_comm["measured"] == check.expert_comm["formula"] and not check.problems
        ratios = {part: m / p for part, m, p in check.rows if m is not None and p}
        assert all(ratios[part] == pytest.approx(1, abs=1e-3) for part in ("parameters", "gradients", "optimizer"))


def test_a_capacity_factor_is_refused_naming_the_value():
    with pytest.raises(UserError, match=r"capacity_factor=1.25: a dry run cannot tell which assignments it drops"):
        _one([*EP, "model.moe.capacity_factor=1.25"])


def test_fsdp_pads_fewer_experts_than_edp_ranks_and_the_planner_prices_it():
    """ep=4 of dp=8 leaves one expert per rank for edp=2 ranks to shard: FSDP2 splits dim 0 (experts)
    and pads it, so every rank holds a whole expert's worth. Before, the planner divided the
    experts by edp and priced half of what the rank holds."""
    run, r, check = _one(["parallel.tp=1", "parallel.ep=4", "parallel.data_parallel=fsdp", "train.micro_batch=2",
                          "train.precision=bf16"])
    ratios = {part: m / p for part, m, p in check.rows if m is not None and p}
    assert all(ratios[part] == pytest.approx(1, abs=0.03) for part in ("parameters", "gradients", "optimizer")), \
        ratios
