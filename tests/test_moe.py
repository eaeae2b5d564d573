"""The MoE layer at t=1 against a per-token reference written from the definitions: routers,
balancing and z losses, capacity, experts, kernels, fp32 routing and the losses' gradient scale."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from seqpar.distributed.mesh import ParallelMesh
from seqpar.errors import UserError
from seqpar.layers.experts import grouped_linear, permute, sort_by_expert, unpermute
from seqpar.model import GPT, GPTConfig
from seqpar.model.moe import LossGradScale, MoE

from moe_helpers import layer_gaps
from seqpar.model.config import MoEConfig


def moe_config(mlp="swiglu", dtype="float64", **moe) -> GPTConfig:
    settings = dict(experts=4, top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
    settings.update(moe)
    return GPTConfig(vocab_size=64, seq_len=8, hidden=16, heads=2, layers=2, ffn_hidden=16, dropout=0.0,
                     attention_dropout=0.0, mlp=mlp, bias=False, recompute="none", dtype=dtype,
                     moe=MoEConfig(**settings))


def layer(cfg: GPTConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    m = MoE(cfg, ParallelMesh.single(), (0.3, 0.3), LossGradScale())
    if m.router.expert_bias is not None:
        m.router.expert_bias.data = torch.tensor([0.3, -0.2, 0.0, 0.5])
    return m


def reference(m: MoE, x: torch.Tensor):
    """(output, aux loss, dropped) from the definitions, one token at a time."""
    moe = m.moe
    xs = x.reshape(-1, x.shape[-1])
    dt = torch.promote_types(xs.dtype, torch.float32)  # fp32 routing at least
    logits = xs.to(dt) @ m.router.weight.to(dt).t()
    n, E, k = xs.shape[0], moe.experts, moe.top_k
    cap = math.inf if moe.capacity_factor is None else math.ceil(moe.capacity_factor * n * k / E)
    taken, outs, counts, probs, dropped = [0] * E, [], torch.zeros(E), [], 0
    for i in range(n):
        if moe.router == "softmax":
            p = torch.softmax(logits[i], -1)
            top = torch.topk(p, k).indices
            w, probs_i = p[top], p
        else:
            s = torch.sigmoid(logits[i])
            top = torch.topk(s + m.router.expert_bias, k).indices
            w, probs_i = s[top], s / s.sum()
        if moe.norm_topk:
            w = w / w.sum()
        w = w * moe.route_scale
        y = torch.zeros_like(xs[i])
        for e, we in zip(top.tolist(), w):
            counts[e] += 1
            if taken[e] >= cap:
                dropped += 1
                continue
            taken[e] += 1
            z = m.experts.w1[e] @ xs[i]
            a = F.silu(z.chunk(2)[0]) * z.chunk(2)[1] if z.shape[0] == 2 * m.experts.w2.shape[-1] else F.gelu(z)
            y = y + we.to(y.dtype) * (m.experts.w2[e] @ a)
        outs.append(y)
        probs.append(probs_i)
    P = torch.stack(probs).mean(0)
    aux = moe.aux_loss_coeff * E / k * ((counts / n) * P).sum()
    aux = aux + moe.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return torch.stack(outs).view_as(x), aux, dropped


def _grads(m, loss):
    return torch.autograd.grad(loss, [p for p in m.parameters() if p.requires_grad])


@pytest.mark.parametrize("mlp,router,extra", [("swiglu", "softmax", {}), ("gelu", "softmax", {"norm_topk": False}),
                                              ("swiglu", "sigmoid", {"route_scale": 2.5}),
                                              ("swiglu", "softmax", {"shared_experts": 1})])
def test_layer_equals_the_per_token_definition_with_its_losses_fp64(mlp, router, extra):
    cfg = moe_config(mlp, router=router, **extra)
    m = layer(cfg)
    x = torch.randn(8, 2, 16, dtype=torch.float64)
    g = torch.randn(8, 2, 16, dtype=torch.float64)
    y = m(x)
    ref, aux, _ = reference(m, x)
    if m.shared is not None:
        ref = ref + m.shared(x)
    assert torch.allclose(y, ref, atol=1e-12, rtol=0)
    # the attached losses get gradient 1 when no loss gradient was captured
    for a, b in zip(_grads(m, (y * g).sum()), _grads(m, (ref * g).sum() + aux)):
        assert torch.allclose(a, b, atol=1e-10, rtol=0)
    assert m.load.tolist() == torch.bincount(m.router.route(m.router(x.reshape(-1, 16)))[0].reshape(-1),
                                             minlength=4).double().tolist()


def test_capacity_factor_drops_the_latest_assignments_and_counts_them():
    cfg = moe_config(capacity_factor=0.5, aux_loss_coeff=0.0, z_loss_coeff=0.0)
    m = layer(cfg)
    x = torch.randn(8, 2, 16, dtype=torch.float64)
    y = m(x)
    ref, _, dropped = reference(m, x)
    assert dropped > 0 and m.dropped.item() == dropped
    assert torch.allclose(y, ref, atol=1e-12, rtol=0)


def test_router_runs_in_fp32_under_a_bf16_model():
    m = layer(moe_config(dtype="bfloat16"))
    x = torch.randn(8, 2, 16, dtype=torch.bfloat16)
    assert m.router(x.reshape(-1, 16)).dtype == torch.float32 and m(x).dtype == torch.bfloat16


def test_grouped_mm_kernel_equals_the_loop_over_experts():
    x = torch.randn(13, 16, requires_grad=True)
    w = torch.randn(4, 32, 16, requires_grad=True)
    counts = torch.tensor([5, 0, 6, 2])
    g = torch.randn(13, 32)
    out = {}
    for kernel in ("grouped_mm", "loop"):
        y = grouped_linear(x, w, counts, kernel)
        out[kernel] = (y, *torch.autograd.grad((y * g).sum(), [x, w]))
    for a, b in zip(out["grouped_mm"], out["loop"]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)


def test_permutation_round_trip_sums_each_tokens_slots_in_order():
    ids = torch.tensor([[2, 0], [0, 1], [2, 1]])
    order, counts = sort_by_expert(ids, 3)
    assert counts.tolist() == [2, 2, 2] and order.tolist() == [1, 2, 3, 5, 0, 4]
    x = torch.arange(6.0).view(3, 2)
    rows = permute(x, order, 2)
    assert rows[:, 0].tolist() == [0, 2, 2, 4, 0, 4]
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert torch.equal(unpermute(rows, order, w), x * w.sum(1, keepdim=True))


def test_aux_losses_take_the_losses_gradient_scale_and_survive_full_recompute():
    """Gradient accumulation scales the loss by 1/accum: the balancing and z losses must scale
    with it, and a full recompute (forward re-run in backward) must give the same gradients."""
    cfg = moe_config(dtype="float64")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = {}
    for mode, scale in (("none", 1.0), ("none", 0.25), ("full", 0.25)):
        model = GPT(dataclasses.replace(cfg, recompute=mode), seed=3)
        (model(tokens, tokens) * scale).backward()
        grads[mode, scale] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert model.blocks[0].mlp.load.sum().item() == 2 * 8 * 2  # counted once, not again by the recompute
    for n, g in grads["none", 1.0].items():
        assert torch.allclose(grads["none", 0.25][n], 0.25 * g, atol=1e-14, rtol=1e-10), n
        assert torch.allclose(grads["full", 0.25][n], 0.25 * g, atol=1e-14, rtol=1e-10), n


def test_moe_layers_are_chosen_by_every_and_first_dense():
    cfg = dataclasses.replace(moe_config(every=2, first_dense=2), layers=6)
    model = GPT(cfg)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MLP", "MLP", "MoE", "MLP", "MoE"]
    for every, first_dense, layers in [(1, 0, 5), (2, 2, 6), (3, 1, 10), (2, 7, 5), (4, 0, 3)]:
        moe = MoEConfig(every=every, first_dense=first_dense)
        assert moe.moe_layer_count(layers) == sum(map(moe.is_moe_layer, range(layers)))


def test_a_million_layer_memory_prediction_is_one_formula_per_kind_of_layer(monkeypatch):
    """The formulas are evaluated per kind of layer (dense or MoE, per recompute mode), not per
    layer: a config the pre-flight refuses must not take minutes to refuse (it once summed a
    million layers' Fractions)."""
    from seqpar.memory import whole_model
    from seqpar.plan.layout import Layout
    from seqpar.plan.memory import per_layer_activations
    calls = []
    terms = whole_model.layer_terms
    monkeypatch.setattr(whole_model, "layer_terms", lambda *a, **k: calls.append(1) or terms(*a, **k))
    for moe in (None, MoEConfig(every=2)):
        cfg = dataclasses.replace(moe_config(), layers=1_000_000, moe=moe)
        few = whole_model.model_activation_bytes(dataclasses.replace(cfg, layers=4), t=1, micro_batch=1)["layers"]
        calls.clear()
        assert whole_model.model_activation_bytes(cfg, t=1, micro_batch=1)["layers"] == few * 250_000
        per_layer_activations(cfg, Layout(tp=1, pp=1, dp=1, micro_batch=1))
        assert len(calls) <= 6, len(calls)  # two kinds of layer x (none, selective); full needs no terms


@pytest.mark.parametrize("bad,match", [(dict(top_k=5), r"top_k \(5\) exceeds experts \(4\)"),
                                       (dict(bias_update_rate=0.1), "balances the sigmoid router"),
                                       (dict(capacity_factor=0.0), "capacity_factor must be")])
def test_bad_moe_settings_are_refused_naming_the_values(bad, match):
    with pytest.raises(UserError, match=match):
        moe_config(**bad).validate()



@pytest.mark.parametrize("mlp,extra", [("swiglu", {}), ("gelu", {"router": "sigmoid", "shared_experts": 1}),
                                       ("swiglu", {"norm_topk": False, "aux_loss_coeff": 0.0, "z_loss_coeff": 0.0}),
                                       ("swiglu", {"recompute_experts": True}), ("gelu", {"recompute_experts": True})])
def test_saved_activations_equal_the_moe_formula(mlp, extra):
    """The ledger's bytes of every layer, MoE and dense, equal the formula's (the norms' small
    statistics aside, which the paper leaves out too), fp32 and bf16."""
    for dtype, act in (("float32", 4), ("bfloat16", 2)):
        cfg = dataclasses.replace(moe_config(mlp, dtype=dtype, **extra), layers=3, recompute="selective")
        cfg.moe.first_dense = 1
        assert layer_gaps(GPT(cfg, seed=1), torch.randint(0, 64, (2, 8)), act=act) == [0, 0, 0]


def test_parameter_count_formula_equals_the_built_model():
    from seqpar.memory.params import stage_params
    for extra in ({}, {"router": "sigmoid", "shared_experts": 1, "every": 2}):
        cfg = dataclasses.replace(moe_config(**extra), layers=4, qk_norm=True, kv_heads=2, norm="rmsnorm")
        assert GPT(cfg).num_parameters(dense=False) == stage_params(cfg, t=1)



def test_recomputing_the_expert_activation_gives_the_same_gradients_and_keeps_less():
    from seqpar.memory.moe import moe_ffn_terms
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    grads, kept = {}, {}
    for recompute in (False, True):
        cfg = moe_config(recompute_experts=recompute)
        model = GPT(cfg, seed=4)
        model(tokens, tokens).backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        kept[recompute] = sum(moe_ffn_terms(cfg, s=8, b=2, t=1, act=8, device="cpu").values())
    assert all(torch.allclose(grads[True][n], g, atol=1e-14, rtol=1e-12) for n, g in grads[False].items())
    assert kept[False] - kept[True] == 2 * 8 * 2 * 2 * 16 * 8 - 8 * 4  # the SwiGLU input [n k, 2f], less the counts


def test_compile_auto_says_why_an_moe_model_runs_eagerly_and_true_is_refused():
    """torchtitan #1668 (compile fails for MoE with selective recompute): seqpar does not compile MoE
    blocks; `auto` says so on a GPU run's first step, `true` is a config error."""
    from types import SimpleNamespace

    from seqpar.config import load_run_config
    from seqpar.parallel.compile import compile_enabled
    from seqpar.parallel.engine import StepEngine
    cfg = load_run_config("moe-tiny-cpu")
    assert not compile_enabled("auto", torch.device("cuda"), cfg.model)
    engine = StepEngine.__new__(StepEngine)
    engine.cfg, engine.mesh, engine.compiled = cfg, SimpleNamespace(device=torch.device("cuda")), None
    assert "auto runs MoE blocks eagerly" in engine.compile_line(0.0)
    with pytest.raises(UserError, match="model.moe with train.compile=true is not supported yet"):
        load_run_config("moe-tiny-cpu", ["train.compile=true"]).validate()
