"""model.recompute: auto and model.recompute_layers: config errors, the model honours a per-layer list
(same loss and grads, RNG-exact, the FLOPs and the bytes the planner predicts), and the planner's
choice under a budget is what the model runs."""
from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distributed_harness import rel_err, tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from seqpar import flops
from seqpar.config import ConfigError, RunConfig, TrainConfig, dump, load_run_config
from seqpar.memory import ActivationLedger
from seqpar.memory.whole_model import model_activation_bytes
from seqpar.model import GPT
from seqpar.plan.gpus import GIB, GPUS
from seqpar.plan.layout import Layout, Recompute
from seqpar.plan.memory import memory_per_gpu, per_layer_activations
from seqpar.plan.recompute import recompute_flops, resolve_recompute
from seqpar.plan.timing import step_time

MIX = ("full", "selective", "none", "full")


# --------------------------------------------------------------------------- config


def test_auto_without_a_budget_names_both_keys():
    with pytest.raises(ConfigError, match=r"model.recompute=auto needs train.memory_budget_gib"):
        load_run_config(None, ["model.recompute=auto"])
    cfg = RunConfig(model=replace(RunConfig().model, recompute="auto"))
    with pytest.raises(ValueError, match=r"model.recompute=auto needs train.memory_budget_gib"):
        cfg.validate()
    with pytest.raises(ValueError, match=r"model.recompute=auto needs train.memory_budget_gib"):
        resolve_recompute(cfg)
    with pytest.raises(ConfigError, match=r"train.memory_budget_gib must be a finite number > 0, got 0"):
        load_run_config(None, ["train.memory_budget_gib=0"])


def test_recompute_layers_load_from_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  layers: 4\n  recompute_layers: [full, selective, none, full]\n")
    from_file = load_run_config(path)
    from_cli = load_run_config(None, ["model.layers=4", "model.recompute_layers=[full, selective, none, full]"])
    assert from_file == from_cli and from_file.model.recompute_layers == MIX
    assert load_run_config(_dumped(tmp_path, from_file)) == from_file  # round trip
    with pytest.raises(ConfigError, match=r"model.recompute_layers has 3 entries but layers is 4.*model.layers"):
        load_run_config(None, ["model.layers=4", "model.recompute_layers=[full,none,none]"])
    with pytest.raises(ConfigError, match=r"model.recompute_layers\[1\]: expected one of"):
        load_run_config(None, ["model.layers=2", "model.recompute_layers=[full,some]"])


def _dumped(tmp_path, cfg):
    out = tmp_path / "dumped.yaml"
    out.write_text(dump(cfg))
    return out


def test_an_unresolved_auto_model_refuses_to_build():
    with pytest.raises(ValueError, match=r"recompute='auto' has no per-layer modes yet: resolve it with "
                                         r"seqpar.plan.resolve_recompute"):
        GPT(tiny_config(recompute="auto"))


# --------------------------------------------------------------------------- the model


def _grads(cfg, seed=3, **kw):
    model = GPT(cfg, seed=seed)
    tokens, labels = batch(cfg)
    torch.manual_seed(11)
    return loss_and_dense_grads(model, tokens, labels)


def _assert_equal(a, b, what):
    assert torch.equal(a[0], b[0]), f"{what}: loss {a[0]} vs {b[0]}"
    for name, g in a[1].items():
        assert torch.equal(g, b[1][name]), f"{what}: grad {name} differs"


def test_per_layer_lists_equal_the_uniform_settings_bit_for_bit_with_dropout():
    """Dropout on: recompute replays the same masks, so every layout of modes gives the same bits."""
    base = dict(layers=4, dropout=0.2, attention_dropout=0.3, sequence_parallel=False)
    ref = _grads(tiny_config(recompute="none", **base))
    for mode in ("none", "selective", "full"):
        uniform = _grads(tiny_config(recompute=mode, **base))
        listed = _grads(tiny_config(recompute_layers=(mode,) * 4, **base))
        _assert_equal(listed, uniform, f"[{mode}]*4 vs uniform {mode}")
        _assert_equal(listed, ref, f"[{mode}]*4 vs none")
    _assert_equal(_grads(tiny_config(recompute_layers=MIX, **base)), ref, f"{MIX} vs none")


def test_runs_and_flags_follow_the_list_and_the_callers_config_is_untouched():
    cfg = tiny_config(layers=4, recompute="selective")
    model = GPT(replace(cfg, recompute_layers=MIX), seed=0)
    assert model.runs == [(0, 1, True), (1, 3, False), (3, 4, True)]
    assert [b.attn.recompute for b in model.blocks] == [False, True, False, False]
    model.set_recompute(["none", "none", "full", "selective"])
    assert model.recompute_modes == ("none", "none", "full", "selective")
    assert model.config.recompute_layers == MIX  # the model's config is left as built
    model.set_recompute("full", "block", 2)  # back to uniform
    assert model.recompute_modes == ("full",) * 4 and model.runs == [(0, 1, True), (1, 2, True), (2, 4, False)]
    assert cfg.recompute_layers is None and cfg.recompute == "selective"
    with pytest.raises(ValueError, match="one mode per layer: got 2 for 4 layers"):
        model.set_recompute(["none", "full"])


def _flops(model, tokens, labels):
    with FlopCounterMode(display=False) as fc:
        model(tokens, labels).backward()
    return fc.get_total_flops()


def test_recomputed_flops_are_the_planners_per_layer_costs():
    cfg = tiny_config(layers=4, seq_len=32)
    tokens, labels = batch(cfg)
    b = tokens.shape[0]
    base = _flops(GPT(cfg, seed=0), tokens, labels)
    mixed_cfg = replace(cfg, recompute_layers=MIX)
    mixed = _flops(GPT(mixed_cfg, seed=0), tokens, labels)
    cost = recompute_flops(cfg, b)
    assert mixed - base == sum(cost[m] for m in MIX) == 2 * cost["full"] + cost["selective"]
    assert mixed == flops.config_hardware_flops(mixed_cfg, B=b)


# --------------------------------------------------------------------------- bytes: measured vs planned

LEDGER_MODEL = dict(vocab_size=64, seq_len=64, hidden=32, heads=4, layers=4, dropout=0.1, attention_dropout=0.1)


def _measured_vs_planned(cfg, group, t, b=2):
    """Ledger bytes per layer of ``cfg`` (fp32, CPU) and the planner's bytes for the same layers."""
    model = GPT(cfg, mesh_for(group), seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with ActivationLedger(model) as ledger:
        model(tokens, tokens)
    layout = Layout(tp=t, pp=1, dp=1, micro_batch=b, sequence_parallel=cfg.sequence_parallel)
    per = per_layer_activations(cfg, layout, "fp32")
    measured = [ledger.per_layer()[f"blocks.{i}"] for i in range(cfg.layers)]
    return measured, [per[m] for m in cfg.recompute_layers]


def _check_within(measured, planned, what, tol=0.03):
    for i, (m, p) in enumerate(zip(measured, planned)):
        assert abs(m - p) <= tol * p, f"{what} layer {i}: measured {m} vs planned {p} ({m / p - 1:+.1%})"
    assert abs(sum(measured) - sum(planned)) <= tol * sum(planned)


def _tiny_run(budget_gib=None, **model):
    return RunConfig(model=tiny_config(**{**LEDGER_MODEL, "sequence_parallel": False, **model}),
                     train=TrainConfig(micro_batch=2, precision="fp32", memory_budget_gib=budget_gib))


def test_resolve_recompute_picks_a_mix_whose_measured_bytes_are_the_planned_ones():
    """A budget between all-none and all-selective: auto picks a genuine mix; the ledger measures the
    model built from it within 3% of the planner's bytes per layer, and the plan fits the budget."""
    run = _tiny_run()
    layout = Layout(tp=1, pp=1, dp=1, micro_batch=2, sequence_parallel=False)
    totals = {k: memory_per_gpu(run.model, replace(layout, recompute=Recompute(k)), 1.0, 2, "fp32").total
              for k in ("none", "selective")}
    budget = (totals["none"] + totals["selective"]) / 2 / GIB
    auto = replace(run, model=replace(run.model, recompute="auto"), train=replace(run.train, memory_budget_gib=budget))
    auto.validate()
    resolved = resolve_recompute(auto)
    modes = resolved.model.recompute_layers
    assert auto.model.recompute_layers is None  # pure: the input is untouched
    assert set(modes) == {"none", "selective"} and len(modes) == 4, modes
    counts = Recompute("mixed", counts=tuple((m, modes.count(m)) for m in ("none", "selective", "full")))
    planned = memory_per_gpu(resolved.model, replace(layout, recompute=counts), budget * GIB, 2, "fp32")
    assert planned.fits
    measured, per_layer = _measured_vs_planned(resolved.model, None, 1)
    _check_within(measured, per_layer, "auto")
    assert abs(sum(measured) - planned.parts["activations"]) <= 0.03 * planned.parts["activations"]
    whole = model_activation_bytes(resolved.model, t=1, micro_batch=2, activation_bytes=4)["layers"]
    assert whole == sum(per_layer)  # seqpar memory's formula and the planner's agree on the list
    with pytest.raises(ValueError, match=r"memory_budget_gib=0.5: memory budget 0.5 GiB is too small: even full "
                                         r"recompute of every layer does not fit; the smallest that fits is 2\.\d\d GiB"):
        resolve_recompute(replace(auto, train=replace(auto.train, memory_budget_gib=0.5)))
    assert resolve_recompute(run) is run  # not auto: unchanged


def _two_ranks(rank, world):
    out = {}
    for t in (1, 2):
        group = tp_group_of(t)
        for sp in (False, True) if t > 1 else (False,):
            cfg = tiny_config(layers=4, sequence_parallel=sp, recompute_layers=MIX)
            model = GPT(cfg, mesh_for(group), seed=3)
            tokens, labels = batch(cfg)
            out[("grads", t, sp)] = loss_and_dense_grads(model, tokens, labels)
        sp_cfg = tiny_config(**{**LEDGER_MODEL, "sequence_parallel": t > 1}, recompute_layers=MIX)
        out[("bytes", t)] = _measured_vs_planned(sp_cfg, group, t)
    return out


def test_per_layer_list_at_t2_with_sp_equals_t1_and_its_bytes_are_planned(spawn):
    for rank, r in enumerate(spawn(_two_ranks, 2)):
        ref_loss, ref_grads = r[("grads", 1, False)]
        for sp in (False, True):
            loss, grads = r[("grads", 2, sp)]
            assert rel_err(loss, ref_loss) <= 1e-5, (rank, sp)
            for name, g in grads.items():
                assert rel_err(g, ref_grads[name]) <= 1e-5, (rank, sp, name)
        for t in (1, 2):
            _check_within(*r[("bytes", t)], f"rank {rank} t={t}")


# --------------------------------------------------------------------------- a paper config


def test_auto_on_the_22b_paper_config_beats_every_uniform_setting():
    """22B at the paper's layout (t=8, b=4, SP) with an 80 GiB budget: no recompute does not fit;
    auto's per-layer list fits and is predicted faster than selective or full everywhere."""
    cfg = load_run_config("paper/22b", ["model.recompute=auto", "train.memory_budget_gib=80",
                                        "train.precision=bf16"])
    modes = resolve_recompute(cfg).model.recompute_layers
    layout = Layout(tp=8, pp=1, dp=1, micro_batch=4, sequence_parallel=True)
    a100 = GPUS["a100-80gb"]
    mix = Recompute("mixed", counts=tuple((m, modes.count(m)) for m in ("none", "selective", "full")))
    kinds = {"auto": mix, **{k: Recompute(k) for k in ("none", "selective", "full")}}
    mem = {k: memory_per_gpu(cfg.model, replace(layout, recompute=rc), a100.hbm_bytes, 4) for k, rc in kinds.items()}
    secs = {k: step_time(cfg.model, replace(layout, recompute=rc), a100, 4).seconds for k, rc in kinds.items()}
    assert not mem["none"].fits and mem["auto"].fits and {"none", "selective"} == set(modes)
    assert secs["auto"] < secs["selective"] < secs["full"]


def test_the_trainer_resolves_recompute_auto_under_its_budget(tmp_path):
    import numpy as np

    from seqpar.config import load_run_config
    from seqpar.distributed.mesh import ParallelMesh
    from seqpar.train import Trainer
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, 4000).astype(np.uint16))
    base = ["model.vocab_size=64", "model.seq_len=16", "model.hidden=16", "model.heads=2", "model.layers=4",
            f"data.source={tmp_path / 'tokens.npy'}", "train.steps=1", "train.micro_batch=2", "train.eval_interval=0",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'out'}", "model.recompute=auto"]
    trainer = Trainer(load_run_config(None, base + ["train.memory_budget_gib=80"]), mesh=ParallelMesh.single())
    try:
        modes = trainer.model.recompute_modes
        assert modes is not None and len(modes) == 4 and set(modes) <= {"none", "selective", "full"}
        assert modes == ("none",) * 4  # 80 GiB holds everything: nothing to recompute
        assert np.isfinite(trainer.train_step(0).loss)
    finally:
        trainer.close()
    with pytest.raises(ValueError, match=r"memory_budget_gib"):
        load_run_config(None, base)
