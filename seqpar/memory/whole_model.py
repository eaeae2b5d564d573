"""Activation bytes of a whole model at a given config: what one rank keeps for backward.

Table 2 counts every layer's activations for 16-bit tensors with dropout everywhere. A real run
differs in ways the paper's derivation already names, and this module applies them term by term:
dropout off keeps no masks (and with attention dropout off the softmax output is also the
dropout output); fp32 activations take 4 bytes where Table 2 counts 2; full recompute keeps one
input per checkpointed unit of layers; and the §4.3 terms outside the layers (embedding dropout
mask, final LayerNorm input, output-layer input, fp32 logits) are added. A per-layer list
(``model.recompute_layers``) sums each layer's own mode, a full layer keeping its input. LayerNorm statistics
and integer token ids are small and left out, as in the paper.

The Llama family generalises three terms (derivation in ``docs/memory.md``): RMSNorm keeps its
input like LayerNorm (only the small per-token statistics differ: no mean); grouped-query
attention keeps K and V of ``g`` heads, ``2sbh g/a`` each; SwiGLU keeps the fused gate and up
(``4sbf``) where GeLU keeps its input (``2sbf``), and both keep the fc2 input (``2sbf``), with
the MLP width ``f`` from the config. RoPE adds nothing: it runs outside the selectively
recomputed region and returns the Q, K, V that attention keeps anyway. The fp32 logits have the
padded vocabulary's columns.
"""
from __future__ import annotations

from fractions import Fraction

from ..model.config import GPTConfig
from ..recompute import full_recompute_plan


def _layer_terms(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, selective: bool) -> dict[str, Fraction]:
    """One layer's kept tensors in bytes (Table 2's derivation, PAPER.md), as this config runs."""
    h, a = cfg.hidden, cfg.heads
    sbh, scores = Fraction(s * b * h), Fraction(a * s * s * b)
    kv, ffn = Fraction(cfg.num_kv_heads, a), Fraction(cfg.ffn_hidden, h)  # g/a and f/h
    rep = t if cfg.sequence_parallel else 1  # the terms plain TP leaves replicated: SP splits them too
    u = Fraction(act, 2)  # Table 2 counts 2-byte activations
    terms = {
        "layernorm_inputs": 4 * sbh * u / rep, "qkv_input": 2 * sbh * u / rep, "fc1_input": 2 * sbh * u / rep,
        "q_k": (2 + 2 * kv) * sbh * u / t, "v": 2 * kv * sbh * u / t, "projection_input": 2 * sbh * u / t,
        "fc2_input": 2 * ffn * sbh * u / t,
    }
    if cfg.mlp == "swiglu":
        terms["swiglu_gate_up"] = 4 * ffn * sbh * u / t
    else:
        terms["gelu_input"] = 2 * ffn * sbh * u / t
    if cfg.dropout > 0:
        terms["dropout_masks"] = 2 * sbh / rep  # 1 byte each, post-attention and post-MLP
    if not selective:
        terms["softmax_output"] = 2 * scores * u / t
        if cfg.attention_dropout > 0:
            terms["softmax_dropout"] = (scores + 2 * scores * u) / t  # 1-byte mask + its output
    return terms


def _extra_terms(cfg: GPTConfig, *, s: int, b: int, t: int, act: int) -> dict[str, Fraction]:
    """§4.3: outside the layers (one pipeline stage holding both ends)."""
    sbh, rep, u = Fraction(s * b * cfg.hidden), (t if cfg.sequence_parallel else 1), Fraction(act, 2)
    terms = {"final_layernorm_input": 2 * sbh * u / rep, "output_layer_input": 2 * sbh * u / rep,
             "logits_fp32": Fraction(4 * s * b * cfg.padded_vocab(t), t)}
    if cfg.dropout > 0:
        terms["embedding_dropout_mask"] = sbh / rep
    return terms


def model_activation_bytes(cfg: GPTConfig, *, t: int, micro_batch: int, activation_bytes: int = 2,
                           seq_len: int | None = None) -> dict[str, int]:
    """Bytes one rank keeps for backward for one micro-batch of ``cfg`` at TP size ``t``:
    ``{"layers": ..., "outside_layers": ..., "total": ...}``. ``activation_bytes``: 2 for bf16
    activations, 4 for fp32 (dropout masks stay 1 byte)."""
    s, b, L = seq_len or cfg.seq_len, micro_batch, cfg.layers
    modes = cfg.layer_recompute()  # model.recompute_layers: one mode per layer, each full layer its own unit
    if modes is not None:
        unit_input = Fraction(2 * s * b * cfg.hidden * activation_bytes, 2 * (t if cfg.sequence_parallel else 1))
        per = {sel: sum(_layer_terms(cfg, s=s, b=b, t=t, act=activation_bytes, selective=sel).values())
               for sel in (False, True)}
        layers = sum(unit_input if m == "full" else per[m == "selective"] for m in modes)
    elif cfg.recompute == "full":
        runs = full_recompute_plan(L, cfg.recompute_method, cfg.recompute_num_layers)
        unit_input = Fraction(2 * s * b * cfg.hidden * activation_bytes, 2 * (t if cfg.sequence_parallel else 1))
        kept = sum(end - begin for begin, end, ckpt in runs if not ckpt)
        per_layer = sum(_layer_terms(cfg, s=s, b=b, t=t, act=activation_bytes, selective=False).values())
        layers = unit_input * sum(1 for *_, ckpt in runs if ckpt) + per_layer * kept
    else:
        selective = cfg.recompute == "selective"
        layers = L * sum(_layer_terms(cfg, s=s, b=b, t=t, act=activation_bytes, selective=selective).values())
    outside = sum(_extra_terms(cfg, s=s, b=b, t=t, act=activation_bytes).values())
    return {"layers": round(layers), "outside_layers": round(outside), "total": round(layers + outside)}


__all__ = ["model_activation_bytes"]
