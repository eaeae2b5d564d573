"""The Llama-family decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention): one model across TP
sizes, sequence parallelism and recompute modes; its pieces' gradients and what they keep."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from distributed_harness import rel_err, run_ranks, tp_group_of
from gpt_helpers import batch, loss_and_dense_grads, mesh_for, tiny_config
from seqpar import flops
from seqpar.config import dump, load_run_config
from seqpar.memory import ActivationLedger, bytes_per_layer
from seqpar.memory.whole_model import model_activation_bytes
from seqpar.model import GPT, GPTConfig
from seqpar.model.config import RopeScaling
from seqpar.model.mlp import _SwiGLUFn
from seqpar.model.norm import _RMSNormFn
from seqpar.model.rope import RopeTables, _RotaryQKV, rope_inv_freq

SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8)


def llama_config(**kw) -> GPTConfig:
    """8 query heads, 4 key/value heads (t = 4 keeps one per rank), an odd vocabulary, untied."""
    base = dict(vocab_size=61, hidden=32, heads=8, kv_heads=4, ffn_hidden=40, norm="rmsnorm", position="rope",
                rope_theta=500000.0, rope_scaling=SCALING, mlp="swiglu", bias=False, tie_embeddings=False)
    return tiny_config(**{**base, **kw})


# (t, sequence_parallel, recompute, method)
LAYOUTS = [(1, False, "none", "uniform"), (2, False, "none", "uniform"), (2, True, "selective", "uniform"),
           (2, True, "full", "block"), (4, True, "none", "uniform"), (4, True, "selective", "uniform"),
           (4, False, "full", "uniform")]


def _layouts(group, t):
    out = {}
    for lt, sp, mode, method in LAYOUTS:
        if lt != t:
            continue
        cfg = llama_config(sequence_parallel=sp, recompute=mode, recompute_method=method, recompute_num_layers=2)
        model = GPT(cfg, mesh_for(group), seed=3)
        tokens, labels = batch(cfg)
        with FlopCounterMode(display=False) as fc:
            loss, grads = loss_and_dense_grads(model, tokens, labels)
        expected = flops.config_hardware_flops(model.config, B=tokens.shape[0], t=t)
        out[(t, sp, mode)] = (loss, grads, model.dense_state_dict(), fc.get_total_flops(), expected)
    return out


def _dropout_exact(group):
    out = {}
    for mode in ("none", "selective", "full"):
        cfg = llama_config(dropout=0.2, attention_dropout=0.3, recompute=mode)
        model = GPT(cfg, mesh_for(group), seed=5)
        tokens, labels = batch(cfg)
        out[mode] = [loss_and_dense_grads(model, tokens, labels) for _ in range(2)]
    return out


# memory: bf16, dropout on, math attention; g = a/2, f = 1.5h, SwiGLU, RMSNorm, RoPE
S, B, H, A, G, F = 32, 2, 256, 8, 4, 384
ROWS = {"tp": (False, "none"), "tp_sp": (True, "none"), "tp_selective": (False, "selective"),
        "tp_sp_selective": (True, "selective"), "full": (False, "full"), "full_sp": (True, "full")}


def memory_config(sp, recompute):
    return GPTConfig(vocab_size=1001, seq_len=S, hidden=H, heads=A, kv_heads=G, ffn_hidden=F, layers=2,
                     norm="rmsnorm", position="rope", mlp="swiglu", bias=False, tie_embeddings=False,
                     dtype="bfloat16", dropout=0.1, attention_dropout=0.1, sequence_parallel=sp, recompute=recompute)


def _memory(group, t):
    out = {}
    for row, (sp, recompute) in ROWS.items():
        model = GPT(memory_config(sp, recompute), mesh_for(group), seed=0)
        tokens = torch.randint(0, 1001, (B, S), generator=torch.Generator().manual_seed(0))
        with ActivationLedger(model) as ledger:
            model(tokens, tokens)
        out[(t, row)] = (ledger.per_layer(), ledger.total())
    return out


def _all_checks(rank, world):
    """One spawn for every multi-rank check of this file: each t's groups, then t=2 for dropout."""
    out = {"layouts": {}, "memory": {}}
    for t in (1, 2, 4):
        group = tp_group_of(t)
        out["layouts"].update(_layouts(group, t))
        out["memory"].update(_memory(group, t))
    out["dropout"] = _dropout_exact(tp_group_of(2))
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_all_checks, 4, tmp_path_factory.mktemp("llama"))


def test_loss_grads_init_and_flops_match_for_every_layout(ranks):
    res = [r["layouts"] for r in ranks]
    ref_loss, ref_grads, ref_weights, _, _ = res[0][(1, False, "none")]
    cfg = llama_config()
    assert ref_weights["wte.weight"].shape == (61, 32) and ref_weights["blocks.0.attn.qkv.weight"].shape == (64, 32)
    assert ref_weights["blocks.0.mlp.fc1.weight"].shape == (80, 32) and "wpe.weight" not in ref_weights
    assert "blocks.0.ln1.bias" not in ref_weights  # RMSNorm: weight only
    for rank, r in enumerate(res):
        for (t, sp, mode), (loss, grads, weights, counted, expected) in r.items():
            key = f"rank {rank} t={t} sp={sp} {mode}"
            assert rel_err(loss, ref_loss) <= 1e-5, f"{key}: loss {loss} vs {ref_loss}"
            for name, g in grads.items():
                assert rel_err(g, ref_grads[name]) <= 1e-5, f"{key}: grad {name} err {rel_err(g, ref_grads[name]):.1e}"
            for name, w in weights.items():  # same seed -> same dense model for every t, padded or not
                assert torch.equal(w, ref_weights[name]), f"{key}: init of {name} depends on t"
            # every matmul is split over TP: each rank executes 1/t of the model's FLOPs
            assert counted * t == expected, f"{key}: FlopCounterMode {counted} x t vs formula {expected}"
    assert cfg.padded_vocab(4) == 64 and cfg.padded_vocab(2) == 62


def test_recompute_is_rng_exact_with_dropout(ranks):
    for r in (r["dropout"] for r in ranks):
        ref = r["none"]
        assert not torch.equal(ref[0][0], ref[1][0])
        for mode in ("selective", "full"):
            for (loss, grads), (ref_loss, ref_grads) in zip(r[mode], ref):
                assert torch.equal(loss, ref_loss), mode
                assert all(torch.equal(g, ref_grads[n]) for n, g in grads.items()), mode


def test_ledger_matches_the_generalised_memory_formulas(ranks):
    """Whole model (docs/memory.md) and Table 2's generalised per-layer rows, within 3%."""
    for rank, r in enumerate(r["memory"] for r in ranks):
        for (t, row), (per_layer, total) in r.items():
            whole = model_activation_bytes(memory_config(*ROWS[row]), t=t, micro_batch=B)["total"]
            assert abs(total / whole - 1) <= 0.03, f"rank {rank} t={t} {row}: ledger {total} vs formula {whole}"
            if row == "full_sp":  # Table 2 has no such row: the layer input's sequence shard
                assert all(v == 2 * S * B * H // t for v in per_layer.values()), (t, per_layer)
                continue
            table2 = bytes_per_layer(row, s=S, b=B, h=H, a=A, t=t, kv_heads=G, ffn_hidden=F, mlp="swiglu")
            assert len(per_layer) == 2
            for layer, measured in per_layer.items():
                assert abs(measured / table2 - 1) <= 0.03, f"rank {rank} t={t} {row} {layer}: {measured} vs {table2}"


def test_sdpa_with_grouped_query_attention_matches_math():
    cfg = llama_config()
    tokens, labels = batch(cfg)
    ref = loss_and_dense_grads(GPT(cfg, seed=2), tokens, labels)
    got = loss_and_dense_grads(GPT(llama_config(attention="sdpa"), seed=2), tokens, labels)
    assert rel_err(got[0], ref[0]) <= 1e-6
    for name, g in got[1].items():
        assert rel_err(g, ref[1][name]) <= 1e-5, name


def test_fused_functions_have_exact_gradients_and_keep_only_what_they_say():
    torch.manual_seed(0)
    x, w = torch.randn(5, 2, 8, dtype=torch.float64, requires_grad=True), torch.randn(8, dtype=torch.float64)
    gate_up = torch.randn(5, 2, 12, dtype=torch.float64, requires_grad=True)
    qkv = torch.randn(5, 2, (4 + 2 * 2) * 6, dtype=torch.float64, requires_grad=True)
    cos, sin = RopeTables(llama_config(hidden=24, heads=4, kv_heads=2)).get(5, torch.float64, torch.device("cpu"))
    w.requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _RMSNormFn.apply(a, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(_SwiGLUFn.apply, (gate_up,))
    assert torch.autograd.gradcheck(lambda a: _RotaryQKV.apply(a, cos, sin, 4, 2, 6), (qkv,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        _RotaryQKV.apply(qkv, cos, sin, 4, 2, 6)
        assert saved == []  # linear: backward needs only the tables
        _SwiGLUFn.apply(gate_up)
        assert [t.data_ptr() for t in saved] == [gate_up.data_ptr()]  # gate and up, not silu(gate)
        saved.clear()
        _RMSNormFn.apply(x, w, 1e-6)
        assert sorted(tuple(t.shape) for t in saved) == [(5, 2, 1), (5, 2, 8), (8,)]  # input, rstd, weight


def test_rope_scaling_matches_hugging_face():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=16,
                                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=8))
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
    assert torch.equal(rope_inv_freq(16, 500000.0, SCALING), expected)


def test_config_checks_and_yaml_round_trip(tmp_path):
    with pytest.raises(ValueError, match=r"position='rope' needs an even head dim; hidden \(36\) / heads \(4\) = 9"):
        GPTConfig(hidden=36, heads=4, position="rope").validate()
    with pytest.raises(ValueError, match=r"rope_scaling is set but position is 'learned'"):
        GPTConfig(rope_scaling=SCALING).validate()
    with pytest.raises(ValueError, match=r"activation='gelu_tanh' applies to mlp='gelu'"):
        GPTConfig(mlp="swiglu", activation="gelu_tanh").validate()
    with pytest.raises(ValueError, match=r"high_freq_factor \(1.0\) must exceed low_freq_factor \(2.0\)"):
        GPTConfig(position="rope", rope_scaling=RopeScaling(low_freq_factor=2.0, high_freq_factor=1.0)).validate()
    assert GPTConfig(hidden=4096, mlp="swiglu").ffn_hidden == 11008  # Llama's 8h/3 rounded up to 256
    path = tmp_path / "run.yaml"
    path.write_text("model: {norm: rmsnorm, position: rope, mlp: swiglu, kv_heads: 4, "
                    "rope_scaling: {factor: 32, original_max_position_embeddings: 8192}}\n")
    cfg = load_run_config(path)
    assert cfg.model.rope_scaling == RopeScaling(factor=32.0) and cfg.model.kv_heads == 4
    (tmp_path / "again.yaml").write_text(dump(cfg))
    assert load_run_config(tmp_path / "again.yaml") == cfg
    with pytest.raises(ValueError, match=r"model.rope_scaling.fator"):
        load_run_config(path, ["model.rope_scaling.fator=2"])
