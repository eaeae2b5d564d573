"""Per-layer recompute under a memory budget: exact, and better than any uniform setting."""
import itertools
from dataclasses import replace

import pytest

from seqpar.model.config import GPTConfig
from seqpar.plan.gpus import GIB, GPUS
from seqpar.plan.layout import Layout, Recompute
from seqpar.plan.memory import memory_per_gpu
from seqpar.plan.paper import paper_run
from seqpar.plan.recompute import (best_mix, layer_modes, recompute_flops, recompute_layers, stage_layer_ids)
from seqpar.plan.timing import step_time

A100 = GPUS["a100-80gb"]
SMALL = GPTConfig(vocab_size=512, seq_len=256, hidden=256, heads=8, layers=6)


def _brute_force(model, layout, budget, batch):
    """Every (none, selective, full) split of a stage: the fewest recomputed FLOPs that fit."""
    n, cost = model.layers // layout.pp, recompute_flops(model, layout.micro_batch)
    best = None
    for full, sel in itertools.product(range(n + 1), repeat=2):
        if full + sel > n:
            continue
        rc = Recompute("mixed", counts=(("none", n - full - sel), ("selective", sel), ("full", full)))
        mem = memory_per_gpu(model, replace(layout, recompute=rc), budget, batch)
        if mem.fits:
            key = (sel * cost["selective"] + full * cost["full"], mem.total)
            best = key if best is None or key < best else best
    return best


ALLOWANCE_MIB = 2560  # the fixed workspace allowance; the small model's own bytes come on top
BUDGETS_MIB = [ALLOWANCE_MIB + x for x in (60, 75, 85, 95, 110, 125)]


@pytest.mark.parametrize("budget_mib", BUDGETS_MIB)
def test_best_mix_is_the_exact_optimum(budget_mib):
    layout = Layout(tp=2, pp=1, dp=1, micro_batch=4, sequence_parallel=True)
    budget = budget_mib * 2**20
    expected = _brute_force(SMALL, layout, budget, 4)
    mix = best_mix(SMALL, layout, budget, 4)
    if expected is None:
        assert mix is None
        return
    counts = mix.per_stage(SMALL.layers)
    cost = recompute_flops(SMALL, 4)
    assert counts["selective"] * cost["selective"] + counts["full"] * cost["full"] == expected[0]
    assert memory_per_gpu(SMALL, replace(layout, recompute=mix), budget, 4).fits


def test_the_budgets_above_cover_every_kind_of_answer():
    layout = Layout(tp=2, pp=1, dp=1, micro_batch=4, sequence_parallel=True)
    kinds = set()
    for mib in BUDGETS_MIB:
        mix = best_mix(SMALL, layout, mib * 2**20, 4)
        kinds.add(None if mix is None else tuple(k for k, v in mix.counts if v))
    assert None in kinds and ("none",) in kinds
    assert ("selective", "full") in kinds and ("none", "selective") in kinds  # genuine mixes


def _uniform(run, kind):
    layout = replace(run.layout, recompute=Recompute(kind))
    return (memory_per_gpu(run.model, layout, A100.hbm_bytes, run.global_batch),
            step_time(run.model, layout, A100, run.global_batch))


def test_mix_beats_every_uniform_setting_on_the_22b_paper_config():
    """22B, t=8, b=4, SP on an 80 GiB A100: no recompute does not fit; the mix fits and recomputes
    fewer FLOPs, and is predicted faster, than selective or full for every layer."""
    run = paper_run("22b")
    mix = best_mix(run.model, run.layout, A100.hbm_bytes, run.global_batch)
    counts = mix.per_stage(run.model.layers)
    assert counts["none"] > 0 and counts["selective"] > 0
    mixed = replace(run.layout, recompute=mix)
    assert memory_per_gpu(run.model, mixed, A100.hbm_bytes, run.global_batch).fits
    t_mix = step_time(run.model, mixed, A100, run.global_batch).seconds
    cost = recompute_flops(run.model, run.layout.micro_batch)
    mix_flops = counts["selective"] * cost["selective"] + counts["full"] * cost["full"]
    assert not _uniform(run, "none")[0].fits
    for kind in ("selective", "full"):
        mem, time = _uniform(run, kind)
        assert mem.fits
        assert mix_flops < run.model.layers * cost[kind]
        assert t_mix < time.seconds


def test_mix_of_full_and_selective_where_selective_does_not_fit():
    run = paper_run("175b")
    budget = 66 * GIB  # selective everywhere needs ~71 GiB, full ~59 GiB
    assert not memory_per_gpu(run.model, run.layout, budget, run.global_batch).fits
    mix = best_mix(run.model, run.layout, budget, run.global_batch)
    counts = mix.per_stage(12)
    assert counts["full"] > 0 and counts["selective"] + counts["none"] > 0
    assert counts["full"] < 12  # cheaper than full recompute of every layer


def test_stage_layer_ids_cover_the_model_once():
    for layers, p, m in ((96, 8, 3), (48, 1, 1), (24, 4, 2)):
        ids = [i for r in range(p) for i in stage_layer_ids(layers, p, m, r)]
        assert sorted(ids) == list(range(layers))
    assert stage_layer_ids(8, 2, 2, 0) == [0, 1, 4, 5]  # chunk j of stage r is block j * p + r


def test_layer_modes_puts_each_stage_counts_on_its_own_layers():
    rc = Recompute("mixed", counts=(("none", 2), ("selective", 3), ("full", 1)))
    modes = layer_modes(rc, 12, pp=2, virtual_stages=1)
    assert len(modes) == 12
    for stage in range(2):
        mine = [modes[i] for i in stage_layer_ids(12, 2, 1, stage)]
        assert mine == ["full", "selective", "selective", "selective", "none", "none"]


def test_recompute_layers_for_a_config_and_budget():
    modes = recompute_layers("paper/22b", 80)
    assert len(modes) == 48 and set(modes) == {"none", "selective"}
    assert modes[: modes.count("selective")] == ["selective"] * modes.count("selective")
    with pytest.raises(ValueError, match="budget 10 GiB is too small.*full recompute"):
        recompute_layers("paper/22b", 10)
    with pytest.raises(ValueError, match="positive number of GiB, got -1"):
        recompute_layers("paper/22b", -1)
