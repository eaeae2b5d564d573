"""Hugging Face Mixtral and Qwen3-MoE (tiny random configs, no downloads) in seqpar's GPT and back:
the same logits, loss and gradients at fp32, and round trips both ways. Parallel layouts of the
same imports are checked in tests/test_moe_parallel.py."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_helpers import hf_reference, perturb, shifted_batch  # noqa: E402
from seqpar.errors import UserError  # noqa: E402
from seqpar.interop.moe_hf import from_hf, to_hf  # noqa: E402
from seqpar.model import GPT  # noqa: E402

B, S, V = 2, 8, 64


def hf_moe(kind: str, seed: int = 0):
    """A tiny Mixtral, or a Qwen3-MoE whose first layer is dense (``mlp_only_layers``)."""
    common = dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=S, rms_norm_eps=1e-6, attn_implementation="eager", num_experts_per_tok=2,
                  tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                                          mlp_only_layers=[0], norm_topk_prob=False, head_dim=4, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    perturb(model, lambda name: "norm" in name, 0.1)
    with torch.no_grad():  # HF initialises the routers and experts small; spread the routing
        for name, p in model.named_parameters():
            if "gate.weight" in name or "experts" in name:
                p.normal_(0.0, 0.5)
    return model.eval()


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_import_gives_hf_logits_loss_and_gradients(kind):
    hf = hf_moe(kind)
    config, state = from_hf(hf, recompute="none")
    config.moe.aux_loss_coeff = 0.0  # HF adds its balancing loss only with output_router_logits
    model = GPT(config)
    model.load_dense_state_dict(state)
    model.eval()
    ids, labels = shifted_batch(V, B, S)
    ref_logits, ref_loss, ref_grads = hf_reference(hf, ids, from_hf)
    with torch.no_grad():
        logits = model(ids)
    assert (logits - ref_logits).abs().max() < 1e-5
    loss = model(ids, labels)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    grads = model.to_dense({n: p.grad for n, p in model.named_parameters()})
    assert set(grads) == set(ref_grads)
    for name, g in grads.items():
        assert torch.allclose(g, ref_grads[name], atol=1e-5, rtol=1e-4), name
    assert type(model.blocks[0].mlp).__name__ == ("MoE" if kind == "mixtral" else "MLP")


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_export_then_import_round_trips_every_tensor(kind):
    hf = hf_moe(kind, seed=1)
    config, state = from_hf(hf)
    back = to_hf(config, GPT(config).dense_state_dict() | state, kind, attn_implementation="eager")
    original, again = hf.state_dict(), back.state_dict()
    assert set(original) == set(again)
    assert all(torch.equal(original[k], again[k]) for k in original)
    assert back.config.num_experts_per_tok == 2 and back.config.router_aux_loss_coef == hf.config.router_aux_loss_coef


def test_import_refuses_what_seqpar_cannot_express():
    hf = hf_moe("qwen3_moe")
    hf.config.mlp_only_layers = [1]
    with pytest.raises(UserError, match=r"mlp_only_layers=\[1\] must be the first layers"):
        from_hf(hf)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_seqpar_import_then_export_round_trips_a_hf_folder(kind, tmp_path):
    """``seqpar import`` of a saved Hugging Face folder, then ``seqpar export --format hf`` of that
    checkpoint: the same model type and every tensor equal."""
    from seqpar.interop.export import export_hf
    from seqpar.interop.hf_import import import_hf
    hf = hf_moe(kind, seed=2)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = import_hf(tmp_path / "hf", tmp_path / "ckpt")
    out = export_hf(ckpt, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert back.config.model_type == kind
    original, again = hf.state_dict(), back.state_dict()
    assert set(original) == set(again) and all(torch.equal(original[k], again[k]) for k in original)
