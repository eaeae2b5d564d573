"""model.recompute_ops (seqpar.model.recompute_ops): norm outputs, activation output and dropout masks rebuilt
in backward. Bit-identical gradients and the same dropout masks as without the choice (t=1, t=2 with and
without SP), the bytes each choice stops keeping equal to its formula (ledger, eager and compiled),
and the config surface that states them."""
import dataclasses

import pytest
import torch

from distributed_harness import tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from seqpar.config import ConfigError, dump, load_run_config
from seqpar.distributed.rng import RNGStreams
from seqpar.memory import ActivationLedger, bytes_per_layer
from seqpar.memory.formulas import recompute_op_coefficients
from seqpar.memory.whole_model import layer_bytes
from seqpar.model import GPT

CHOICES = (("norm",), ("activation",), ("dropout",), ("norm", "activation", "dropout"))
LLAMA = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, kv_heads=2)


def _same_step(base, ops, mesh=None):
    """Loss and dense grads without and with ``ops`` equal bit for bit."""
    tokens, labels = batch(base)
    l0, g0 = loss_and_dense_grads(GPT(base, mesh, seed=1), tokens, labels)
    l1, g1 = loss_and_dense_grads(GPT(dataclasses.replace(base, recompute_ops=ops), mesh, seed=1), tokens, labels)
    return bool(l0.equal(l1)) and all(g0[k].equal(g1[k]) for k in g0)


@pytest.mark.parametrize("family", [{}, LLAMA], ids=["gpt", "llama"])
def test_each_choice_gives_bit_identical_gradients_at_t1(family):
    for rc, attention, dtype in (("none", "sdpa", "bfloat16"), ("selective", "math", "float32")):
        base = tiny_config(dropout=0.1, attention_dropout=0.1, recompute=rc, attention=attention, dtype=dtype,
                           **family)
        for ops in CHOICES:
            assert _same_step(base, ops), (family, rc, attention, ops)


def test_redrawn_dropout_draws_the_stored_mask_and_advances_the_stream_alike():
    x = torch.randn(16, 2, 32, requires_grad=True)
    kept, redrawn = RNGStreams(5), RNGStreams(5)
    y0, y1 = kept.dropout(x, 0.3), redrawn.dropout(x, 0.3, redraw=True)
    assert y0.equal(y1) and kept.states["tp"].equal(redrawn.states["tp"])
    g = torch.randn_like(y0)
    (d0,) = torch.autograd.grad(y0, x, g)
    (d1,) = torch.autograd.grad(y1, x, g)
    assert d1.equal(d0) and (d1 == 0).any()  # the same mask, redrawn from the state before the draw


def _tp_grads_equal(rank, world):
    group, out = tp_group_of(2), {}
    for sp in (True, False):
        base = tiny_config(dropout=0.1, attention_dropout=0.1, recompute="selective", sequence_parallel=sp, layers=2)
        for ops in CHOICES if sp else CHOICES[-1:]:  # plain TP: all three together
            out[(sp, ops)] = _same_step(base, ops, mesh_for(group))
    return out


def test_each_choice_gives_bit_identical_gradients_at_t2_with_and_without_sp(spawn):
    for res in spawn(_tp_grads_equal, 2):
        assert all(res.values()), {k: v for k, v in res.items() if not v}


# ----------------------------------------------------------------------------- bytes = formula
SHAPE = dict(s=32, b=2, h=64, a=4)


def _layer_bytes(t, group, ops, rc="selective", attention="math", p_attn=0.1, **kw):
    cfg = tiny_config(vocab_size=128, seq_len=SHAPE["s"], hidden=SHAPE["h"], heads=SHAPE["a"], layers=2,
                      dtype="bfloat16", dropout=0.1, attention_dropout=p_attn, recompute=rc, attention=attention,
                      recompute_ops=ops, **kw)
    model = GPT(cfg, mesh_for(group), seed=0)
    tokens = torch.randint(0, 128, (SHAPE["b"], SHAPE["s"]))
    with ActivationLedger(model) as ledger:
        model(tokens, tokens)
    return cfg, ledger.per_layer()


def _ledger_vs_formula(rank, world):
    out = []
    for t in (1, 2):
        group = tp_group_of(t)
        for ops in ((), *CHOICES):
            _, per = _layer_bytes(t, group, ops)  # math kernel, selective: Table 2's row
            out.append((t, ops, "math", per, bytes_per_layer("tp_sp_selective", t=t, recompute_ops=ops, **SHAPE)))
            cfg, per = _layer_bytes(t, group, ops, rc="none", attention="sdpa", p_attn=0.0)  # CPU's fused kernel
            formula = layer_bytes(cfg, "none", s=SHAPE["s"], b=SHAPE["b"], t=t, act=2, device="cpu")
            out.append((t, ops, "sdpa", per, formula))
    return out


def test_ledger_measures_each_choice_as_its_formula_eager(spawn):
    for rank, rows in enumerate(spawn(_ledger_vs_formula, 2)):
        for t, ops, kernel, per_layer, formula in rows:
            assert len(per_layer) == 2
            for layer, measured in per_layer.items():
                assert abs(measured - formula) <= 0.01 * formula, (rank, t, ops, kernel, layer, measured, formula)


def test_choice_coefficients_are_the_stated_table_rows():
    gpt = recompute_op_coefficients(h=64, a=4)
    assert gpt == {"norm": 4, "activation": 8, "dropout": 2}
    llama = recompute_op_coefficients(h=64, a=4, kv_heads=2, ffn_hidden=176, mlp="swiglu")
    assert llama["activation"] == 2 * 176 / 64 and llama["norm"] == 4
    sbh_t = 32 * 2 * 64 / 2
    kept = {ops: bytes_per_layer("tp_sp_selective", t=2, recompute_ops=ops, **SHAPE) / sbh_t for ops in CHOICES}
    assert kept == {("norm",): 30, ("activation",): 26, ("dropout",): 32, ("norm", "activation", "dropout"): 20}
    with pytest.raises(ValueError, match="full"):
        bytes_per_layer("full", recompute_ops=("norm",), **SHAPE)


def test_compiled_choices_keep_the_formula_bytes_and_the_eager_gradients():
    """LayerNorm, GeLU and dropout rebuilt by a compiled block (its checkpoint policy recomputes
    LayerNorm and GeLU; dropout redraws inside its op): no graph break, the eager loss and gradients
    bit for bit, Table 2's row less the three choices (the compiled block also recomputes LayerNorm's
    small statistics, which the eager one keeps and the paper leaves out)."""
    from test_compile import GPT2, _compare, _config
    ops = ("norm", "activation", "dropout")
    r = _compare(_config(GPT2, "selective", 0.1, dtype="bfloat16", recompute_ops=ops), "selective")
    assert r["breaks"] == 0 and r["dloss"] == 0.0 and r["dgrad"] == 0.0
    compiled, eager = r["bytes"]  # two layers
    formula = 2 * bytes_per_layer("tp_sp_selective", s=32, b=2, h=32, a=4, recompute_ops=ops)
    assert abs(compiled - formula) <= 0.01 * formula and compiled <= eager, (compiled, eager, formula)


# ----------------------------------------------------------------------------- config
def test_yaml_and_overrides_set_the_choices_and_round_trip(tmp_path):
    cfg = load_run_config("tiny-cpu", ["model.dropout=0.1", "model.recompute_ops=[norm,dropout]"])
    assert cfg.model.recompute_ops == ("norm", "dropout")
    path = tmp_path / "run.yaml"
    path.write_text(dump(cfg))
    assert load_run_config(path).model.recompute_ops == ("norm", "dropout")
    assert load_run_config("tiny-cpu").model.recompute_ops == ()  # empty by default: today's layers
    layers = load_run_config("tiny-cpu", ["model.layers=2", "model.recompute_layers=[full,none]",
                                          "model.recompute_ops=[activation]"])
    assert layers.model.recompute_ops == ("activation",)


@pytest.mark.parametrize("overrides, named", [
    (["model.recompute_ops=[norm,gelu]"], "gelu"),
    (["model.recompute_ops=[norm,norm]"], "norm"),
    (["model.recompute_ops=[norm]", "model.recompute=full"], "full"),
    (["model.layers=2", "model.recompute_layers=[full,full]", "model.recompute_ops=[norm]"], "full"),
    (["model.recompute_ops=[dropout]", "model.dropout=0"], "dropout=0"),
    (["model.norm=rmsnorm", "model.recompute_ops=[norm]", "train.compile=true"], "rmsnorm"),
    (["model.mlp=swiglu", "model.recompute_ops=[activation]", "train.compile=true"], "swiglu"),
])
def test_unknown_or_meaningless_choices_are_refused_by_name(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_run_config("tiny-cpu", overrides)


def test_compiled_choices_are_accepted_and_checkpoints_may_change_them():
    load_run_config("tiny-cpu", ["model.dropout=0.1", "model.recompute_ops=[norm,activation,dropout]",
                                 "train.compile=true", "model.norm=layernorm", "model.mlp=gelu"])
    load_run_config("tiny-cpu", ["model.mlp=swiglu", "model.recompute_ops=[norm]", "train.compile=true"])
    from seqpar.checkpoint.compat import model_changes
    a = tiny_config()
    assert model_changes(a, dataclasses.replace(a, recompute_ops=("norm",))) == []  # a runtime key


# ----------------------------------------------------------------------------- auto and the planner
def _none_total(run, layout, ops=()):
    from seqpar.plan.layout import Recompute
    from seqpar.plan.memory import memory_per_gpu
    return memory_per_gpu(run.model, dataclasses.replace(layout, recompute=Recompute("none", ops=ops)), 1.0, 2,
                          "fp32").total


@pytest.mark.parametrize("fits, expected", [((), ("dropout",)), (("dropout",), ("norm",)),
                                            (("norm", "dropout"), ("activation",))])
def test_auto_takes_the_cheapest_allowed_choice_that_fits_and_the_ledger_agrees(fits, expected):
    """A budget one byte under what a run with the ``fits`` choices keeps: auto takes the subset with
    the fewest recomputed FLOPs that fits (dropout 4sbh FLOPs for 2sbh bytes, norm 16sbh for 8sbh in
    fp32, activation 32sbh for 32sbh), keeps every layer at none, and the model built from it
    measures the planned bytes."""
    from test_recompute_auto import _check_within, _measured_vs_planned, _tiny_run
    from seqpar.plan.gpus import GIB
    from seqpar.plan.layout import Layout
    from seqpar.plan.recompute import resolve_recompute
    run = _tiny_run()
    layout = Layout(tp=1, pp=1, dp=1, micro_batch=2, sequence_parallel=False)
    budget = (_none_total(run, layout, fits) - 1) / GIB
    model = dataclasses.replace(run.model, recompute="auto", recompute_ops=("norm", "activation", "dropout"))
    auto = dataclasses.replace(run, model=model, train=dataclasses.replace(run.train, memory_budget_gib=budget))
    auto.validate()
    resolved = resolve_recompute(auto).model
    assert resolved.recompute_ops == expected and set(resolved.recompute_layers) == {"none"}, resolved
    assert _none_total(run, layout, expected) <= budget * GIB
    _check_within(*_measured_vs_planned(resolved, None, 1), f"auto {expected}")
    plain = dataclasses.replace(auto, model=dataclasses.replace(model, recompute_ops=()))
    assert set(resolve_recompute(plain).model.recompute_layers) != {"none"}  # without choices: attention cores


def test_the_planner_mixes_with_choices_and_is_predicted_faster_on_22b():
    """22B at t=8, b=4, SP on an 80 GiB A100: the mix with op-level choices fits with fewer selective
    layers than the plain mix and is predicted faster; the search offers such mixes when allowed to."""
    from seqpar.plan.gpus import GPUS
    from seqpar.plan.memory import memory_per_gpu
    from seqpar.plan.paper import paper_run
    from seqpar.plan.recompute import best_choice, best_mix
    from seqpar.plan.search import Problem, SearchSpace, search
    from seqpar.plan.timing import step_time
    a100, run = GPUS["a100-80gb"], paper_run("22b")
    plain = best_mix(run.model, run.layout, a100.hbm_bytes, run.global_batch)
    chosen = best_choice(run.model, run.layout, a100.hbm_bytes, run.global_batch)
    assert chosen.ops and chosen.per_stage(48)["selective"] < plain.per_stage(48)["selective"]
    layouts = {k: dataclasses.replace(run.layout, recompute=rc) for k, rc in (("plain", plain), ("ops", chosen))}
    assert memory_per_gpu(run.model, layouts["ops"], a100.hbm_bytes, run.global_batch).fits
    secs = {k: step_time(run.model, lay, a100, run.global_batch).seconds for k, lay in layouts.items()}
    assert secs["ops"] < secs["plain"]
    problem = Problem(run.model, gpus=8, gpu=a100, global_batch=run.global_batch, headroom=0.0)
    space = dict(tp=(8,), sequence_parallel=(True,), recompute=("none", "selective", "full", "mixed"),
                 data_parallel=("ddp",), cp=(1,))
    found = search(problem, SearchSpace(**space, recompute_ops=("norm", "activation", "dropout")), k=50).ranked
    with_ops = [c for c in found if c.layout.recompute.ops]
    assert with_ops and all("+" in c.layout.label() and c.memory.fits for c in with_ops)
    assert not any(c.layout.recompute.ops for c in search(problem, SearchSpace(**space), k=50).ranked)  # not asked


def test_the_planner_writes_the_choices_into_the_train_overrides_and_auto_takes_them_again():
    from seqpar.plan.gpus import GIB, GPUS
    from seqpar.plan.paper import paper_run
    from seqpar.plan.recompute import best_choice, resolve_recompute
    from seqpar.plan.report import overrides
    a100, run = GPUS["a100-80gb"], paper_run("22b")
    chosen = best_choice(run.model, run.layout, a100.hbm_bytes, run.global_batch)
    layout = dataclasses.replace(run.layout, recompute=chosen)
    items, _ = overrides(layout, run.model, run.global_batch, "bf16", a100.hbm_bytes / GIB)
    assert "model.recompute_ops=[" + ",".join(chosen.ops) + "]" in items and "model.recompute=auto" in items
    resolved = resolve_recompute(load_run_config("paper/22b", items)).model
    assert resolved.recompute_ops == chosen.ops
    assert resolved.recompute_layers.count("selective") == chosen.per_stage(run.model.layers)["selective"]


def test_the_peak_ledger_leaves_out_the_generator_states_as_the_ledger_does():
    """A redrawn dropout keeps its stream state (5,056 bytes on the CPU): bookkeeping both ledgers
    leave out, so the pipeline's peak check sees the bytes the formula counts."""
    from seqpar.memory import PeakActivationLedger
    cfg = tiny_config(dropout=0.1, attention_dropout=0.1, recompute="selective", recompute_ops=("dropout",))
    model, (tokens, labels) = GPT(cfg, seed=0), batch(cfg)
    with ActivationLedger(model) as flat:
        model(tokens, labels)
    with PeakActivationLedger(model) as peak:
        model(tokens, labels).backward()
    assert peak.peak_layer_bytes == sum(flat.per_layer().values())


def _train_both(rank, world, overrides, layout):
    from seqpar import init_parallel
    from seqpar.train import train
    tp, dp, pp = layout
    mesh = init_parallel(tp=tp, dp=dp, pp=pp)
    out = {}
    for ops in ("[]", "[norm,activation,dropout]"):
        sizes = [f"parallel.tp={tp}", f"parallel.dp={dp}", f"parallel.pp={pp}", f"model.recompute_ops={ops}"]
        out[ops] = train(load_run_config(None, [*overrides[ops], *sizes]), mesh=mesh)["losses"]
    return out


@pytest.mark.parametrize("layout, extra", [((1, 2, 1), {"parallel.data_parallel": "fsdp"}),
                                           ((1, 1, 2), {"parallel.pp_schedule": "1F1B"})], ids=["fsdp", "pp"])
def test_training_with_every_choice_equals_training_without(spawn, tmp_path, layout, extra):
    from run_helpers import TINY_MODEL, run_overrides
    run = {**TINY_MODEL, "model.heads": 4, "model.layers": 2, "model.dropout": 0.1, "model.attention_dropout": 0.1,
           "train.steps": 2, "train.micro_batch": 2, "train.global_batch": 8, "train.eval_interval": 0,
           "checkpoint.interval": 0, **extra}
    overrides = {ops: run_overrides(tmp_path / str(i), run) for i, ops in enumerate(("[]", "[norm,activation,dropout]"))}
    for losses in spawn(_train_both, 2, overrides, layout):
        assert losses["[]"] == losses["[norm,activation,dropout]"], losses


def _compiled_t2(rank, world):
    from test_compile import GPT2, _compare, _config
    cfg = _config(GPT2, "selective", 0.1, sp=True, dtype="bfloat16", recompute_ops=("norm", "activation", "dropout"))
    return _compare(cfg, "selective", mesh_for(tp_group_of(2)), wire=True)


def test_compiled_choices_at_t2_with_sp_keep_the_formula_bytes_and_the_eager_wire(spawn):
    """Rebuilding the norm outputs adds no collective: the compiled block gathers the rebuilt shard as
    it gathered the kept one."""
    formula = 2 * bytes_per_layer("tp_sp_selective", s=32, b=2, h=32, a=4, t=2,
                                  recompute_ops=("norm", "activation", "dropout"))
    for r in spawn(_compiled_t2, 2):
        assert r["breaks"] == 0 and r["dloss"] == 0.0 and r["dgrad"] == 0.0
        assert abs(r["bytes"][0] - formula) <= 0.01 * formula and r["wire"][0] == r["wire"][1], r


def test_the_dry_run_measures_the_choices_as_the_planner_counts_them():
    """``seqpar train --dry-run`` (fake tensors: the rebuilt tensors are recognised by their storage); at h = 64
    LayerNorm's statistics, which the formula leaves out, are 0.6% of the rest."""
    from seqpar.tools.dryrun_report import dry_run
    base = ["model.vocab_size=64", "model.seq_len=32", "model.hidden=64", "model.heads=4", "model.layers=2",
            "model.dropout=0.1", "parallel.tp=2", "train.micro_batch=2", "train.global_batch=4"]
    acts = {}
    for ops in ("[]", "[norm,activation,dropout]"):
        (_, _, check), = dry_run(load_run_config(None, [*base, f"model.recompute_ops={ops}"]), 2, [0], device="cpu")
        acts[ops] = next((m, p) for part, m, p in check.rows if part == "activations")
        assert abs(acts[ops][0] / acts[ops][1] - 1) < 0.01, (ops, acts[ops])
    assert acts["[norm,activation,dropout]"][0] < 0.75 * acts["[]"][0]


def test_seqpar_plan_searches_the_choices_it_is_given(capsys):
    """`seqpar plan --recompute-ops` ranks mixes whose none / selective layers add the choices, and
    the best layout's `seqpar train` line carries them; an unknown choice is one line, exit 2."""
    from seqpar import cli
    args = ["plan", "paper/175b", "--gpus", "64", "--gpu", "a100-80gb", "--space", "paper", "--top", "3"]
    assert cli.main(args + ["--recompute-ops", "activation"]) == 0
    out = capsys.readouterr().out
    best = next(line for line in out.splitlines() if line.startswith("best:"))
    assert "+activation" in best, out
    assert "model.recompute_ops=[activation]" in out, out
    assert cli.main(args + ["--recompute-ops", "norm,gelu"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "seqpar plan: --recompute-ops has unknown value(s) ['gelu']; choose from " \
                          "['norm', 'activation', 'dropout']", err


def test_the_run_header_and_seqpar_memory_name_the_choices(tmp_path, capsys):
    """The first log line says which choices run (before: only `recompute=selective`), and `seqpar
    memory` adds Table 2's last row with them (before: the config's choices were not shown)."""
    import numpy as np

    from seqpar import cli
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 128, 4000).astype(np.uint16))
    args = ["train", "model.vocab_size=128", "model.seq_len=32", "model.hidden=32", "model.heads=4", "model.layers=2",
            "train.micro_batch=4", "train.steps=1", "train.eval_interval=0", "checkpoint.interval=0",
            "model.recompute_ops=[norm,activation]", f"data.source={tmp_path / 'tokens.npy'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'out'}"]
    assert cli.main(args) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "recompute=selective+norm+activation;" in header, header
    assert cli.main(["memory", "paper/175b", "model.recompute_ops=[norm,activation,dropout]"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("with model.recompute_ops [norm, activation, dropout]: TP + SP + selective keeps "
                           "60.00 MiB per layer (20 sbh/t, 58.8% of the row above)"), line
