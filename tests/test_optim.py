"""The optimizer's edges: TP-aware clipping against the dense model, the no-decay group, the LR schedule."""
import math

import pytest
import torch
import torch.nn as nn
from distributed_harness import tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config

from seqpar.layers import VocabParallelEmbedding
from seqpar.model import GPT
from seqpar.parallel.grads import clip_grad_norm
from seqpar.train.optim import build_optimizer, lr_at


def _clip_at_tp2(rank, world, max_norm):
    """The GPT at t=2 (SP on): grad norm and clipped grads, gathered to the dense layout."""
    cfg = tiny_config(dtype="float64", tie_embeddings=False)
    model = GPT(cfg, mesh_for(tp_group_of(2)), seed=5)
    loss_and_dense_grads(model, *batch(cfg, b=2, seed=1))
    norm = clip_grad_norm(model, max_norm, tp_group=model.tp_group)
    return float(norm), model.to_dense({n: p.grad for n, p in model.named_parameters()})


def test_clip_grad_norm_tp_equals_torch_on_the_dense_model(spawn):
    cfg = tiny_config(dtype="float64", tie_embeddings=False, sequence_parallel=False)
    dense = GPT(cfg, seed=5)  # the same full model: initialisation does not depend on the layout
    dense(*batch(cfg, b=2, seed=1)).backward()
    full_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), float("inf")))
    max_norm = full_norm / 3  # clipping scales every grad by about 1/3
    ref_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm))
    ref = {n: p.grad for n, p in dense.named_parameters()}
    results = spawn(_clip_at_tp2, 2, max_norm)
    for norm, clipped in results:
        assert norm == pytest.approx(ref_norm, rel=1e-10) and norm == pytest.approx(full_norm, rel=1e-10)
        assert set(clipped) == set(ref)
        for name, g in ref.items():
            torch.testing.assert_close(clipped[name], g, rtol=1e-9, atol=1e-12, msg=name)
    assert math.isclose(float(torch.cat([g.flatten() for g in ref.values()]).norm()), max_norm, rel_tol=1e-5)


def _expected_no_decay(model: nn.Module) -> set[str]:
    """Norm weights and biases, every bias, token and position embeddings: found by module kind."""
    names = set()
    for mod_name, module in model.named_modules():
        kind = type(module).__name__.lower()
        is_norm = "norm" in kind
        is_embedding = isinstance(module, (nn.Embedding, VocabParallelEmbedding))
        for p_name, _ in module.named_parameters(recurse=False):
            if is_norm or is_embedding or p_name == "bias":
                names.add(f"{mod_name}.{p_name}" if mod_name else p_name)
    return names


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=False, bias=False)])
def test_no_decay_group_is_exactly_norms_biases_and_embeddings(kw):
    model = GPT(tiny_config(**kw))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    decay, no_decay = opt.param_groups
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    name_of = {id(p): n for n, p in model.named_parameters()}
    expected = _expected_no_decay(model)
    assert {name_of[id(p)] for p in no_decay["params"]} == expected
    assert {name_of[id(p)] for p in decay["params"]} == set(name_of.values()) - expected
    assert expected >= {"wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "blocks.0.ln1.bias"}
    assert ("blocks.0.attn.qkv.bias" in expected) == kw.get("bias", True), "linear biases, when there are any"
    assert ("lm_head.weight" in name_of.values()) == (not kw.get("tie_embeddings", True))
    assert all(p.dim() == 2 for p in decay["params"]) and len(decay["params"]) >= 4 * model.config.layers


def test_lr_schedule_at_its_boundaries():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, total_steps=14)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0], "linear warm-up, reaching lr at its end"
    assert lr_at(4, **kw) == 1.0, "cosine starts at lr"
    assert lr_at(9, **kw) == pytest.approx(0.55), "halfway down: (lr + min_lr) / 2"
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(100, **kw) == pytest.approx(0.1), "floor after the end"
    cosine = [lr_at(s, **kw) for s in range(4, 15)]
    assert all(a > b for a, b in zip(cosine, cosine[1:])), "strictly decreasing after warm-up"
    assert lr_at(13, **kw) > 0.1
    no_warmup = dict(kw, warmup_steps=0)
    assert lr_at(0, **no_warmup) == 1.0 and lr_at(7, **no_warmup) == pytest.approx(0.55)
    assert lr_at(0, **dict(kw, total_steps=4)) == 0.25 and lr_at(4, **dict(kw, total_steps=4)) == 1.0
    assert lr_at(5, **dict(kw, total_steps=4)) == pytest.approx(0.1), "warm-up as long as the run: then the floor"
