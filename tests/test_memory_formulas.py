"""Table 2, §4.2.3, §4.3 and Figures 1 / 7 of the paper, checked against seqpar.memory.formulas; Table 2
generalised to the Llama family (its ledger check on the real model is in test_llama.py)."""
from decimal import ROUND_HALF_EVEN, Decimal
from fractions import Fraction

import pytest

from seqpar.memory import (
    SELECTIVE_DROPPED,
    TECHNIQUES,
    ModelShape,
    activation_breakdown,
    attention_score_share,
    bytes_per_layer,
    extra_bytes,
    first_stage_bytes,
    gib,
    interleave_factor,
    load_shape,
    paper_shapes,
    per_gpu_bytes,
    ratio_to_tp,
)
from seqpar.memory.formulas import split_coefficient

GPT3 = dict(s=2048, b=1, h=12288, a=96)
MTNLG = dict(s=2048, b=1, h=20480, a=128)


def r2(x: float) -> float:
    """Round to 2 decimals, ties to even (22B's 9.5625 and 1T's 26.5625 GiB are exact ties)."""
    return float(Decimal(x).quantize(Decimal("0.01"), rounding=ROUND_HALF_EVEN))


# Figure 1: GiB per GPU, TP baseline and TP + SP + selective recompute.
FIGURE1 = {"22B": (59.25, 9.56), "175B": (66.84, 12.35), "530B": (114.02, 23.08), "1T": (131.25, 26.56)}
# Per-layer ratio to TP in percent: +SP, +selective, both, full recompute.
FIGURE7 = {
    "22B": (66.77, 49.37, 16.14, 7.59),
    "175B": (61.96, 56.52, 18.48, 8.70),
    "530B": (58.33, 61.90, 20.24, 9.52),
    "1T": (58.33, 61.90, 20.24, 9.52),
}


@pytest.fixture(scope="module")
def shapes() -> dict[str, ModelShape]:
    return paper_shapes()


def test_paper_configs_match_table3(shapes):
    assert list(shapes) == ["22B", "175B", "530B", "1T"]
    assert shapes["22B"] == ModelShape("22B", s=2048, b=4, h=6144, a=64, L=48, v=51200, t=8, p=1, m=1)
    assert shapes["175B"] == ModelShape("175B", s=2048, b=1, h=12288, a=96, L=96, v=51200, t=8, p=8, m=3)
    assert shapes["530B"] == ModelShape("530B", s=2048, b=1, h=20480, a=128, L=105, v=51200, t=8, p=35, m=3)
    assert shapes["1T"] == ModelShape("1T", s=2048, b=1, h=25600, a=160, L=128, v=51200, t=8, p=64, m=1)


@pytest.mark.parametrize("name", list(FIGURE1))
def test_figure1_gib_per_gpu(shapes, name):
    tp, both = FIGURE1[name]
    assert r2(gib(per_gpu_bytes(shapes[name], "tp"))) == tp
    assert r2(gib(per_gpu_bytes(shapes[name], "tp_sp_selective"))) == both


def test_1t_uses_plain_1f1b():
    """131.25 GiB needs factor 1: 1T is not interleaved (1 + (p-1)/p would nearly double it)."""
    one_t = paper_shapes()["1T"]
    assert interleave_factor(64, 1) == 1.0
    assert r2(gib(per_gpu_bytes(one_t, "tp")) * (1 + 63 / 64)) == 260.45


@pytest.mark.parametrize("name", list(FIGURE7))
def test_figure7_ratios(shapes, name):
    sh = shapes[name]
    dims = dict(s=sh.s, b=sh.b, h=sh.h, a=sh.a, t=sh.t)
    got = tuple(r2(100 * ratio_to_tp(k, **dims)) for k in ("tp_sp", "tp_selective", "tp_sp_selective", "full"))
    assert got == FIGURE7[name]
    assert ratio_to_tp("tp_sp_selective", **dims) < 0.21  # "under 20%", about 5x
    assert 0.07 < ratio_to_tp("full", **dims) < 0.10  # "about 10%"


@pytest.mark.parametrize("dims", [GPT3, MTNLG, dict(s=512, b=3, h=768, a=12), dict(s=100, b=2, h=48, a=3)])
@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_table2_identities(dims, t):
    s, b, h, a = dims["s"], dims["b"], dims["h"], dims["a"]
    sbh, r = s * b * h, 5 * a * s / h
    row = {k: bytes_per_layer(k, **dims, t=t) for k in TECHNIQUES}
    assert row["tp_sp_selective"] == pytest.approx(34 * sbh / t, rel=1e-15)
    assert row["full"] == 2 * sbh
    assert row["none"] == pytest.approx(sbh * (34 + r), rel=1e-15)
    assert row["tp_sp"] == pytest.approx(row["none"] / t, rel=1e-15)
    assert row["tp"] - row["tp_selective"] == pytest.approx(5 * a * s * s * b / t, rel=1e-12)
    assert row["tp_sp"] - row["tp_sp_selective"] == pytest.approx(5 * a * s * s * b / t, rel=1e-12)
    assert row["none"] >= row["tp"] >= row["tp_sp"] >= row["tp_sp_selective"]
    for k in TECHNIQUES:  # the named terms add up to Table 2's closed form
        assert sum(activation_breakdown(k, **dims, t=t).values()) == pytest.approx(row[k], rel=1e-12)


@pytest.mark.parametrize("dims", [GPT3, dict(s=512, b=3, h=768, a=12)])
def test_tp1_is_no_parallelism(dims):
    for k, base in (("tp", "none"), ("tp_sp", "none"), ("tp_sp_selective", "tp_selective")):
        assert bytes_per_layer(k, **dims, t=1) == bytes_per_layer(base, **dims)
    assert activation_breakdown("tp", **dims, t=1) == activation_breakdown("none", **dims)


def test_breakdown_blocks():
    s, b, h, a = 2048, 2, 1024, 16
    sbh, score = s * b * h, a * s * s * b
    terms = activation_breakdown("none", s=s, b=b, h=h, a=a)
    attn = ["qkv_input", "qk", "softmax_out", "softmax_dropout_mask", "softmax_dropout_out", "v", "proj_input",
            "attn_dropout_mask"]
    mlp = ["fc1_input", "gelu_input", "fc2_input", "mlp_dropout_mask"]
    assert sum(terms[k] for k in attn) == 11 * sbh + 5 * score
    assert sum(terms[k] for k in mlp) == 19 * sbh
    assert terms["layernorm_inputs"] == 4 * sbh
    tp = activation_breakdown("tp", s=s, b=b, h=h, a=a, t=8)
    replicated = [k for k in tp if tp[k] == terms[k]]
    assert sorted(replicated) == sorted(["layernorm_inputs", "qkv_input", "attn_dropout_mask", "fc1_input",
                                         "mlp_dropout_mask"])
    assert sum(tp[k] for k in replicated) == 10 * sbh
    sel = activation_breakdown("tp_sp_selective", s=s, b=b, h=h, a=a, t=8)
    assert not set(SELECTIVE_DROPPED) & set(sel)
    assert all(sel[k] == terms[k] / 8 for k in sel)


def test_section5_score_share():
    """5as/h = 80 (GPT-3) and 64 (MT-NLG): about 70% and 65% of the activations."""
    assert 5 * GPT3["a"] * GPT3["s"] / GPT3["h"] == 80
    assert 5 * MTNLG["a"] * MTNLG["s"] / MTNLG["h"] == 64
    assert round(100 * attention_score_share(s=2048, h=12288, a=96)) == 70
    assert round(100 * attention_score_share(s=2048, h=20480, a=128)) == 65


def test_pipeline_first_stage():
    per_layer = bytes_per_layer("tp_sp", **GPT3, t=8)
    assert first_stage_bytes(per_layer, L=96, p=8) == per_layer * 96  # L layers' worth under 1F1B
    assert interleave_factor(8, 3) == pytest.approx(1 + 7 / 24)
    assert first_stage_bytes(per_layer, L=96, p=8, m=3) == pytest.approx(per_layer * 96 * (1 + 7 / 24))
    assert interleave_factor(1, 4) == 1.0
    with pytest.raises(ValueError):
        interleave_factor(0, 1)


def test_extra_terms():
    s, b, h, v, t, p = 2048, 1, 12288, 51200, 8, 8
    extra = extra_bytes(s=s, b=b, h=h, v=v, t=t, p=p)
    assert extra == {
        "embedding_dropout_mask": s * b * h * p // t,
        "final_layernorm_input": 2 * s * b * h // t,
        "output_layer_input": 2 * s * b * h // t,
        "logits_fp32": 4 * s * b * v // t,
    }


def test_validation_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown technique 'sp'"):
        bytes_per_layer("sp", s=1, b=1, h=1, a=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive ints"):
        bytes_per_layer("tp", s=0, b=1, h=8, a=1, t=2)
    with pytest.raises(ValueError, match="not divisible"):
        ModelShape("x", s=8, b=1, h=10, a=3, L=1, v=8, t=1)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {seq_len: 8}\ntrain: {micro_batch: 1}\n")
    with pytest.raises(ValueError, match="missing config key"):
        load_shape(bad)


def test_load_shape_uses_the_strict_loader(tmp_path):
    cfg = tmp_path / "m.yaml"
    cfg.write_text("model: {seq_len: 8, hidden: 8e3, heads: 2, layers: 1, vocab_size: 8}\ntrain: {micro_batch: 1}\n")
    with pytest.raises(ValueError, match=r"m\.yaml: model\.hidden: expected int, got 8000\.0"):
        load_shape(cfg)
    assert load_shape("paper/22b") == paper_shapes()["22B"]  # a shipped config by name


def test_generalised_terms_reduce_to_table_2_and_add_up():
    gpt = dict(s=512, b=3, h=768, a=12)
    assert split_coefficient(h=768, a=12) == 24
    for k in ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full"):
        assert bytes_per_layer(k, **gpt, t=4, kv_heads=12, ffn_hidden=3072) == bytes_per_layer(k, **gpt, t=4)
    # Llama 3 8B: g = a/4, f = 3.5h, SwiGLU: c = 4 + 1 + 6 * 3.5 = 26, so TP+SP+selective keeps 36sbh/t
    llama = dict(s=8192, b=1, h=4096, a=32, kv_heads=8, ffn_hidden=14336, mlp="swiglu")
    assert split_coefficient(**{k: llama[k] for k in ("h", "a", "kv_heads", "ffn_hidden", "mlp")}) == 26
    assert bytes_per_layer("tp_sp_selective", **llama, t=8) == 36 * 8192 * 4096 // 8
    terms = activation_breakdown("tp", **llama, t=8)
    sbh = 8192 * 4096
    assert terms["qk"] == Fraction(5, 2) * sbh / 8 and terms["v"] == sbh / 2 / 8
    assert terms["swiglu_gate_up"] == 14 * sbh / 8 and terms["fc2_input"] == 7 * sbh / 8 and "gelu_input" not in terms
    for k in ("none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full"):
        assert sum(activation_breakdown(k, **llama, t=8).values()) == pytest.approx(bytes_per_layer(k, **llama, t=8))
    shape = ModelShape("8B", s=8192, b=1, h=4096, a=32, L=32, v=128256, t=8, g=8, f=14336, mlp="swiglu")
    assert per_gpu_bytes(shape, "tp_sp_selective") == 32 * bytes_per_layer("tp_sp_selective", **shape.layer_dims)
    assert ModelShape("x", s=8, b=1, h=8, a=2, L=1, v=8, t=1, g=2, f=32) == ModelShape("x", s=8, b=1, h=8, a=2, L=1,
                                                                                      v=8, t=1)
    with pytest.raises(ValueError, match=r"kv_heads \(3\) must divide heads \(8\)"):
        bytes_per_layer("tp", s=8, b=1, h=64, a=8, kv_heads=3)
