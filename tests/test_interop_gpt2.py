"""GPT-2 checkpoints in seqpar's GPT and back: same logits, loss and gradients at t=1 and t=2."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed_harness import rel_err, tp_group_of  # noqa: E402
from gpt_helpers import loss_and_dense_grads, mesh_for  # noqa: E402
from hf_helpers import hf_reference, perturb, shifted_batch  # noqa: E402
from seqpar.distributed.collectives import all_gather_dim  # noqa: E402
from seqpar.interop.gpt2 import from_hf, to_hf  # noqa: E402
from seqpar.model import GPT  # noqa: E402

B, S, V = 2, 16, 64


def hf_gpt2(seed=0, **kw):
    cfg = dict(vocab_size=V, n_positions=S, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
               attn_implementation="eager")
    cfg.update(kw)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg)).eval()
    perturb(model, lambda name: name.endswith("bias") or ".ln_" in name, 0.05)
    return model


def seqpar_run(hf, group, **overrides):
    """seqpar's GPT loaded from ``hf``: full logits (gathered over TP), loss and dense gradients."""
    config, state = from_hf(hf, **overrides)
    model = GPT(config, mesh_for(group))
    model.load_dense_state_dict(state)
    model.eval()
    ids, labels = shifted_batch(V, B, S)
    with torch.no_grad():
        logits = all_gather_dim(model(ids), group, -1)  # [b, s, v/t] -> [b, s, v]
    loss, grads = loss_and_dense_grads(model, ids, labels)
    return logits, loss, grads


def _t2(rank, world):
    group = tp_group_of(world)
    return {(tied, sp, rc): seqpar_run(hf_gpt2(tie_word_embeddings=tied), group, sequence_parallel=sp, recompute=rc)
            for tied, sp, rc in ((True, True, "selective"), (True, False, "none"), (False, True, "none"))}


def check(result, reference, what):
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = result, reference
    assert rel_err(logits, ref_logits) <= 1e-5, f"{what}: logits err {rel_err(logits, ref_logits):.1e}"
    assert rel_err(loss, ref_loss) <= 1e-5, f"{what}: loss {loss} vs {ref_loss}"
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel_err(g, ref_grads[name]) <= 1e-5, f"{what}: grad {name} err {rel_err(g, ref_grads[name]):.1e}"


def test_converted_gpt2_matches_at_t1_and_t2(spawn):
    refs = {tied: hf_reference(hf_gpt2(tie_word_embeddings=tied), shifted_batch(V, B, S)[0], from_hf)
            for tied in (True, False)}
    check(seqpar_run(hf_gpt2(), None, sequence_parallel=False), refs[True], "t=1")
    check(seqpar_run(hf_gpt2(tie_word_embeddings=False), None), refs[False], "t=1 untied")
    for rank, r in enumerate(spawn(_t2, 2)):
        for (tied, sp, rc), result in r.items():
            check(result, refs[tied], f"t=2 rank {rank} tied={tied} sp={sp} recompute={rc}")


def test_round_trips():
    hf = hf_gpt2()
    back = to_hf(*from_hf(hf), attn_implementation="eager")
    assert all(torch.equal(back.state_dict()[k], v) for k, v in hf.state_dict().items())
    assert back.lm_head.weight is back.transformer.wte.weight
    config, _ = from_hf(hf, recompute="none")
    gpt = GPT(config, seed=4).eval()  # a seqpar-initialised model goes to transformers unchanged
    ids, labels = shifted_batch(V, B, S)
    out = to_hf(config, gpt.dense_state_dict(), attn_implementation="eager").eval()(
        input_ids=ids, labels=ids, use_cache=False)
    assert rel_err(out.logits, gpt(ids)) <= 1e-5 and rel_err(out.loss, gpt(ids, labels)) <= 1e-5


def test_unsupported_and_malformed_inputs_raise():
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        from_hf(hf_gpt2(scale_attn_by_inverse_layer_idx=True))
    config, state = from_hf(hf_gpt2())
    del state["blocks.1.mlp.fc2.bias"]
    with pytest.raises(ValueError, match=r"missing \['blocks.1.mlp.fc2.bias'\]"):
        to_hf(config, state)


ARCHITECTURE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "resid_pdrop", "embd_pdrop",
                "attn_pdrop", "layer_norm_epsilon", "activation_function", "initializer_range", "tie_word_embeddings")


def test_config_round_trip_carries_the_whole_architecture():
    """Every GPT-2 setting that changes what the model computes survives from_hf -> to_hf; one that
    seqpar's GPT cannot hold (different embedding and residual dropout) raises instead of vanishing.
    A compiled model converts like the plain one."""
    hf = hf_gpt2(n_positions=24, n_inner=48, resid_pdrop=0.05, embd_pdrop=0.05, attn_pdrop=0.2,
                 layer_norm_epsilon=1e-6, initializer_range=0.03, tie_word_embeddings=False)
    back = to_hf(*from_hf(hf), attn_implementation="eager")
    assert {k: getattr(back.config, k) for k in ARCHITECTURE} == {k: getattr(hf.config, k) for k in ARCHITECTURE}
    with pytest.raises(ValueError, match=r"embd_pdrop=0.0 != resid_pdrop=0.1"):
        from_hf(hf_gpt2(embd_pdrop=0.0, resid_pdrop=0.1))
    (config, state), (c_config, c_state) = from_hf(hf), from_hf(torch.compile(hf))
    assert c_config == config and state.keys() == c_state.keys()
    assert all(torch.equal(state[k], c_state[k]) for k in state)
