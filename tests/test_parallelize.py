"""Drop-in parallelization of Hugging Face GPT-2 and Llama: same loss, gradients and training curve
as the unparallelized model; RNG-exact selective recomputation; clear plan errors."""
import copy
import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

from distributed_harness import rel_err, run_ranks, tp_group_of  # noqa: E402
from dropin_helpers import B, S, batch, gpt2, grads_of, llama, loss_of  # noqa: E402
from gpt_helpers import mesh_for  # noqa: E402
from seqpar import parallelize, plans  # noqa: E402
from seqpar.distributed import RNGStreams  # noqa: E402
from seqpar.dropin import Plan, checkpoint_attention, dense_state_dict  # noqa: E402
from seqpar.layers import ColumnParallelLinear  # noqa: E402

BUILD = {"gpt2": (gpt2, plans.gpt2), "llama": (llama, plans.llama)}
DROPOUT = {"gpt2": dict(attn_pdrop=0.3, resid_pdrop=0.1, embd_pdrop=0.1), "llama": dict(attention_dropout=0.3)}


def step_losses(model, ids, steps=5, lr=0.3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_of(model, ids)
        loss.backward()
        opt.step()
        out.append(loss.detach())
    return out


def _ranks(rank, world):
    group = tp_group_of(world)
    mesh, ids, out = mesh_for(group), batch(), {}
    for name, (build, plan) in BUILD.items():
        dense = build()
        loss = loss_of(dense, ids)
        loss.backward()
        out[(name, "dense")] = (loss.detach(), grads_of(dense, False))
        for sp in (False, True):
            model = parallelize(build(), plan(), mesh, sequence_parallel=sp)
            loss = loss_of(model, ids)
            loss.backward()
            out[(name, sp)] = (loss.detach(), grads_of(model, True))
        out[(name, "train")] = (step_losses(build(), ids),
                                step_losses(parallelize(build(), plan(), mesh), ids))
        # selective recompute with dropout, under TP + SP: bit-identical to keeping the activations
        runs = []
        for ckpt in (False, True):
            model = parallelize(build(**DROPOUT[name]), plan(), mesh)
            if ckpt:
                checkpoint_attention(model)
            torch.manual_seed(7)
            runs.append([(l, grads_of(model, True)) for l in _two_steps(model, ids)])
        out[(name, "rng")] = runs
    runs = []  # attention dropout from per-rank seqpar streams: recompute replays them too
    for ckpt in (False, True):
        model, streams = parallelize(gpt2(**DROPOUT["gpt2"]), plans.gpt2(), mesh), RNGStreams(11, tp_rank=rank)
        checkpoint_attention(model, streams=streams) if ckpt else _attention_from_streams(model, streams)
        torch.manual_seed(7)
        runs.append([(l, grads_of(model, True)) for l in _two_steps(model, ids)])
    out[("gpt2", "rng_streams")] = runs
    errors = []
    for build, plan, kw in ((gpt2, plans.gpt2, dict(n_embd=33, n_head=3)),
                            (llama, plans.llama, dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)),
                            (gpt2, lambda: Plan(layers={"transformer.h.*.attn.c_attn": "column"}), {}),
                            (gpt2, lambda: dataclasses.replace(plans.gpt2(), seq_dim=None), {})):
        model = build(**kw)
        try:
            parallelize(model, plan(), mesh)
        except ValueError as e:
            errors.append((str(e), any(isinstance(m, ColumnParallelLinear) for m in model.modules())))
    out["errors"] = errors
    return out


def _attention_from_streams(model, streams):
    """Reference: GPT-2's eager attention drawing dropout from ``streams``, without recompute."""
    eager = transformers.models.gpt2.modeling_gpt2.eager_attention_forward

    def attention(module, q, k, v, mask, **kw):
        with streams.fork("tp"):
            return eager(module, q, k, v, mask, **kw)[0], None

    name = f"test_streams_{id(model)}"
    transformers.AttentionInterface.register(name, attention)
    transformers.AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    model.set_attn_implementation(name)


def _two_steps(model, ids):
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, ids)
        loss.backward()
        yield loss.detach()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_ranks, 2, tmp_path_factory.mktemp("parallelize"))


@pytest.mark.parametrize("name", list(BUILD))
def test_loss_and_grads_match_dense_at_t2(ranks, name):
    for rank, r in enumerate(ranks):
        ref_loss, ref_grads = r[(name, "dense")]
        for sp in (False, True):
            loss, grads = r[(name, sp)]
            assert rel_err(loss, ref_loss) <= 1e-5, f"{name} rank {rank} sp={sp}: loss {loss} vs {ref_loss}"
            assert grads.keys() == ref_grads.keys()
            for n, g in grads.items():
                err = rel_err(g, ref_grads[n])
                assert err <= 1e-5, f"{name} rank {rank} sp={sp}: grad {n} err {err:.1e}"


@pytest.mark.parametrize("name", list(BUILD))
def test_training_moves_loss_like_dense(ranks, name):
    for r in ranks:
        dense, par = r[(name, "train")]
        assert all(b < a for a, b in zip(dense, dense[1:])) and dense[-1] < 0.9 * dense[0], f"{name}: {dense}"
        for a, b in zip(par, dense):
            assert rel_err(a, b) <= 1e-5, f"{name}: parallel {par} vs dense {dense}"


@pytest.mark.parametrize("name", [*BUILD, "gpt2 with seqpar streams"])
def test_checkpoint_attention_is_rng_exact_under_tp_sp(ranks, name):
    for r in ranks:
        plain, ckpt = r[("gpt2", "rng_streams") if "streams" in name else (name, "rng")]
        assert not torch.equal(plain[0][0], plain[1][0]), "dropout should change the loss between steps"
        for (l0, g0), (l1, g1) in zip(plain, ckpt):
            assert torch.equal(l0, l1)
            for n in g0:
                assert torch.equal(g0[n], g1[n]), f"{name}: {n} differs under recompute"


def test_plan_errors_name_the_problem_and_change_nothing(ranks):
    (heads, _), (gqa, _), (sp, _), (seq_dim, _) = errors = ranks[0]["errors"]
    assert "config.n_head = 3 not divisible by t=2" in heads and "out_features 99 not divisible" in heads
    assert "config.num_key_value_heads = 3 and t=2: t must divide it or be a multiple of it" in gqa
    assert "plan.sp_start" in sp  # sequence parallelism needs the region's boundaries
    assert "plan.seq_dim" in seq_dim and "1 for batch-first [b, s, h]" in seq_dim  # and the sequence dim stated
    assert not any(touched for _, touched in errors), "a rejected plan must leave the model unchanged"
    with pytest.raises(ValueError, match="'transformer.h.*.attn.qkv' matches no module"):
        parallelize(gpt2(), Plan(layers={"transformer.h.*.attn.qkv": "column"}), None)
    with pytest.raises(ValueError, match="transformer.wpe \\(column\\) must be nn.Linear or Conv1D"):
        parallelize(gpt2(), Plan(layers={"transformer.wpe": "column"}), None)


def test_single_rank_pass_and_selective_recompute_flops():
    ids = batch()
    dense = gpt2()
    model = parallelize(copy.deepcopy(dense), plans.gpt2(), None)
    assert torch.equal(loss_of(model, ids), loss_of(dense, ids))
    assert all(torch.equal(a, dense.state_dict()[k]) for k, a in dense_state_dict(model).items())
    padded = llama(pad_token_id=0)  # nn.Embedding(padding_idx=0): row 0 gets no gradient
    ids_with_pad = ids.masked_fill(ids % 3 == 0, 0)
    for m in (padded, parallelize(copy.deepcopy(padded), plans.llama(), None)):
        loss_of(m, ids_with_pad).backward()
    ref, got = grads_of(padded, False), grads_of(m, True)
    assert not ref["model.embed_tokens.weight"][0].any()
    assert all(rel_err(got[n], g) <= 1e-6 for n, g in ref.items())

    def flops(m):
        with FlopCounterMode(display=False) as fc:
            loss_of(m, ids).backward()
        return fc.get_total_flops()

    base = flops(model)
    extra = flops(checkpoint_attention(model)) - base
    h, layers = 32, 2
    assert extra == layers * 4 * B * S * S * h  # QK^T and attention-over-V, recomputed once per layer


def test_checkpoint_attention_sdpa_is_rng_exact_and_bad_models_raise():
    ids, runs = batch(), []
    for ckpt in (False, True):
        model = llama(attn_implementation="sdpa", attention_dropout=0.3)
        if ckpt:
            checkpoint_attention(model)
        torch.manual_seed(3)
        runs.append([(l, grads_of(model, False)) for l in _two_steps(model, ids)])
    for (l0, g0), (l1, g1) in zip(*runs):
        assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)
    with pytest.raises(ValueError, match="neither seqpar's GPT nor a transformers model"):
        checkpoint_attention(torch.nn.Linear(2, 2))
    model = llama(attn_implementation="flex_attention")
    with pytest.raises(ValueError, match="'eager' and 'sdpa'.*'flex_attention'"):
        checkpoint_attention(model)


def test_checkpoint_attention_registers_once_and_each_model_keeps_its_streams():
    """Repeated calls and further models add nothing to transformers' registries, and each model's
    recomputed dropout still draws from its own streams (model 1 runs after model 2 was
    checkpointed with other streams)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ids = batch()

    def sizes():
        return len(ALL_ATTENTION_FUNCTIONS), len(ALL_MASK_ATTENTION_FUNCTIONS)

    def run(model):
        torch.manual_seed(7)
        return [(l, grads_of(model, False)) for l in _two_steps(model, ids)]

    refs = {}
    for seed in (11, 12):  # no recompute, attention dropout from a fresh RNGStreams(seed)
        model = gpt2(**DROPOUT["gpt2"])
        _attention_from_streams(model, RNGStreams(seed))
        refs[seed] = run(model)
    assert not torch.equal(refs[11][0][0], refs[12][0][0]), "the streams should change the loss"
    first = checkpoint_attention(gpt2(**DROPOUT["gpt2"]), streams=RNGStreams(11))
    before = sizes()
    checkpoint_attention(first, streams=RNGStreams(11))  # again: only replaces the streams
    second = checkpoint_attention(gpt2(**DROPOUT["gpt2"]), streams=RNGStreams(12))
    assert sizes() == before
    assert first.config._attn_implementation == second.config._attn_implementation == "seqpar_selective_eager"
    for seed, model in ((11, first), (12, second)):
        for (l0, g0), (l1, g1) in zip(refs[seed], run(model)):
            assert torch.equal(l0, l1), f"streams {seed}: loss {l1} vs {l0}"
            assert all(torch.equal(g0[n], g1[n]) for n in g0), f"streams {seed}: gradients differ"
