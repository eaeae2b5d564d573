"""Hugging Face Llama checkpoints in seqpar's GPT and back (randomly initialised, no downloads): same
logits, loss and gradients at t=1 and t=2 with SP; grouped-query attention, untied embeddings, an odd
vocabulary, Llama 3 RoPE scaling; round trips both ways."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from distributed_harness import rel_err, tp_group_of  # noqa: E402
from gpt_helpers import loss_and_dense_grads, mesh_for  # noqa: E402
from hf_helpers import hf_reference, perturb, shifted_batch  # noqa: E402
from seqpar.distributed.collectives import all_gather_dim  # noqa: E402
from seqpar.interop.llama import from_hf, to_hf  # noqa: E402
from seqpar.model import GPT, GPTConfig  # noqa: E402

B, S, V = 2, 16, 97
LLAMA3 = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=8)
# GQA + untied + Llama 3 scaling; and plain multi-head attention, tied, with biases
VARIANTS = {"gqa_untied": dict(num_key_value_heads=2, tie_word_embeddings=False, rope_parameters=LLAMA3),
            "mha_tied_bias": dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True)}


def hf_llama(variant: str, seed: int = 0):
    cfg = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=S, rms_norm_eps=1e-6, attn_implementation="eager", **VARIANTS[variant])
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    perturb(model, lambda name: "norm" in name or name.endswith("bias"), 0.1)
    return model


def _compare(rank, world):
    out = {}
    for t in (1, 2):
        group = tp_group_of(t)
        for variant in VARIANTS:
            hf = hf_llama(variant)
            config, state = from_hf(hf, sequence_parallel=t > 1, recompute="selective")
            model = GPT(config, mesh_for(group))
            model.load_dense_state_dict(state)
            model.eval()
            ids, labels = shifted_batch(V, B, S)
            with torch.no_grad():
                logits = all_gather_dim(model(ids), group, -1)[..., :V]  # [b, s, v_pad/t] -> [b, s, v]
            loss, grads = loss_and_dense_grads(model, ids, labels)
            out[(t, variant)] = (logits, loss, grads, hf_reference(hf, shifted_batch(V, B, S)[0], from_hf))
    return out


def test_logits_loss_and_grads_equal_hugging_face_at_t_1_and_2(spawn):
    for rank, r in enumerate(spawn(_compare, 2)):
        for (t, variant), (logits, loss, grads, (hf_logits, hf_loss, hf_grads)) in r.items():
            key = f"rank {rank} t={t} {variant}"
            assert rel_err(logits, hf_logits) <= 1e-5, key
            assert rel_err(loss, hf_loss) <= 1e-5, key
            assert set(grads) == set(hf_grads), key
            for name, g in grads.items():
                assert rel_err(g, hf_grads[name]) <= 1e-5, f"{key}: {name} {rel_err(g, hf_grads[name]):.1e}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_round_trips(variant):
    hf = hf_llama(variant)
    config, state = from_hf(hf)
    assert (config.kv_heads, config.tie_embeddings, config.bias) == (
        hf.config.num_key_value_heads, hf.config.tie_word_embeddings, hf.config.attention_bias)
    back = to_hf(config, state, attn_implementation="eager")
    theirs = hf.state_dict()
    assert set(back.state_dict()) == set(theirs)
    assert all(torch.equal(w, theirs[n]) for n, w in back.state_dict().items())
    ids, _ = shifted_batch(V, B, S)
    assert torch.equal(back(input_ids=ids).logits, hf(input_ids=ids).logits)
    # seqpar -> HF -> seqpar: the dense state dict and the model config survive
    model = GPT(config, seed=3)
    dense = model.dense_state_dict()
    config2, dense2 = from_hf(to_hf(model.config, dense))
    assert config2 == model.config
    assert all(torch.equal(dense2[n], w) for n, w in dense.items()) and set(dense2) == set(dense)


def test_unsupported_models_are_refused_naming_the_option():
    hf = hf_llama("gqa_untied")
    hf.config.hidden_act = "gelu"
    with pytest.raises(ValueError, match=r"hidden_act='gelu'"):
        from_hf(hf)
    hf.config.hidden_act, hf.config.rope_parameters = "silu", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(ValueError, match=r"rope_type='yarn'"):
        from_hf(hf)
    gpt2_shaped = GPTConfig(vocab_size=V, seq_len=S, hidden=32, heads=4, layers=1)
    with pytest.raises(ValueError, match=r"needs norm='rmsnorm', position='rope', mlp='swiglu'; got \{'norm'"):
        to_hf(gpt2_shaped, {})
