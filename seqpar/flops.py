"""FLOP counts of a GPT model (Korthikanti et al. 2022, Appendix A) and MFU / HFU helpers.

Notation: B batch (sequences per iteration), s sequence length, h hidden, L layers, v vocabulary.
Only matrix multiplications are counted (2 FLOPs per multiply-add); backward costs twice the
forward. Integer inputs give exact integer counts: the factored forms of the paper are expanded,
e.g. 72BLsh^2(1 + s/(6h) + v/(12hL)) = 72BLsh^2 + 12BLs^2h + 6Bshv.

The general decoder (:func:`decoder_layer_forward_flops`, :func:`config_model_flops`,
:func:`config_hardware_flops`) adds a heads, g key/value heads and MLP width f: QKV
``2Bsh^2 (1 + 2g/a)``, projection ``2Bsh^2``, MLP ``4Bshf`` (GeLU, 2 matrices) or ``6Bshf``
(SwiGLU, 3 matrices), attention core ``4Bs^2h``; the logits use the padded vocabulary, the rows
the output layer really multiplies. Norms, RoPE and activations are elementwise: not counted.
"""
from __future__ import annotations

import math
import os
from typing import Literal

from .errors import UserError
from .model.config import GPTConfig
from .model.modes import RECOMPUTE_MODES, RecomputeMode as Recompute
from .recompute import checkpoint_runs


def layer_forward_flops(*, B: int, s: int, h: int) -> int:
    """Forward FLOPs of one transformer layer: 24Bsh^2 + 4Bs^2h.

    24Bsh^2: QKV (6Bsh^2), output projection (2Bsh^2), MLP h->4h->h (16Bsh^2).
    4Bs^2h: the attention core, QK^T (2Bs^2h) and attention over V (2Bs^2h).
    """
    return 24 * B * s * h * h + attention_core_forward_flops(B=B, s=s, h=h)


def attention_core_forward_flops(*, B: int, s: int, h: int) -> int:
    """Forward FLOPs of QK^T and attention-over-V in one layer, 4Bs^2h: what selective recompute repeats."""
    return 4 * B * s * s * h


def logits_forward_flops(*, B: int, s: int, h: int, v: int) -> int:
    """Forward FLOPs of the output layer [B*s, h] x [h, v]: 2Bshv."""
    return 2 * B * s * h * v


def model_flops(*, B: int, s: int, h: int, L: int, v: int) -> int:
    """Model FLOPs per iteration (forward + backward, no recompute): 72BLsh^2(1 + s/(6h) + v/(12hL)).

    Equals 3 x (L x :func:`layer_forward_flops` + :func:`logits_forward_flops`).
    """
    return 72 * B * L * s * h * h + 12 * B * L * s * s * h + 6 * B * s * h * v


def hardware_flops(recompute: Recompute, *, B: int, s: int, h: int, L: int, v: int) -> int:
    """FLOPs the hardware executes per iteration, recomputation included.

    none: :func:`model_flops`.
    selective: 72BLsh^2(1 + s/(3h) + v/(12hL)), Appendix A's hardware count, the one behind the
      paper's HFU figures (Table 5). It charges 12BLs^2h for the recomputed attention core,
      three times its forward cost 4BLs^2h (:func:`attention_core_forward_flops`).
    full: every layer's forward runs twice, 4 forward passes' worth of layers:
      96BLsh^2(1 + s/(6h)) + 6Bshv (the output layer is not recomputed).
    """
    if recompute == "none":
        return model_flops(B=B, s=s, h=h, L=L, v=v)
    if recompute == "selective":
        return 72 * B * L * s * h * h + 24 * B * L * s * s * h + 6 * B * s * h * v
    if recompute == "full":
        return 4 * L * layer_forward_flops(B=B, s=s, h=h) + 3 * logits_forward_flops(B=B, s=s, h=h, v=v)
    raise ValueError(f"unknown recompute mode {recompute!r}; expected one of {RECOMPUTE_MODES}")


def decoder_layer_forward_flops(*, B: int, s: int, h: int, heads: int, kv_heads: int | None = None,
                                ffn_hidden: int | None = None, mlp: Literal["gelu", "swiglu"] = "gelu") -> int:
    """Forward FLOPs of one general decoder layer: QKV ``2Bsh(h + 2hg/a)``, projection ``2Bsh^2``,
    MLP ``4Bshf`` (GeLU) or ``6Bshf`` (SwiGLU: gate, up and down), attention core ``4Bs^2h``.
    GPT (g = a, f = 4h, GeLU) gives :func:`layer_forward_flops`, ``24Bsh^2 + 4Bs^2h``."""
    g, f = kv_heads or heads, ffn_hidden or 4 * h
    if mlp not in ("gelu", "swiglu") or heads % g or h % heads:
        raise ValueError(f"need h % heads == 0, heads % kv_heads == 0 and mlp 'gelu' or 'swiglu'; got h={h}, "
                         f"heads={heads}, kv_heads={g}, mlp={mlp!r}")
    qkv = 2 * B * s * h * (h + 2 * (h // heads) * g)
    mlp_flops = (6 if mlp == "swiglu" else 4) * B * s * h * f
    return qkv + 2 * B * s * h * h + mlp_flops + attention_core_forward_flops(B=B, s=s, h=h)


def config_layer_forward_flops(cfg: GPTConfig, *, B: int, layer: int = 0) -> int:
    """Forward FLOPs of layer ``layer`` of ``cfg`` for ``B`` sequences (:func:`decoder_layer_forward_flops`;
    an MoE layer's FFN counted by :func:`moe_ffn_forward_flops` instead of the dense MLP)."""
    dense = decoder_layer_forward_flops(B=B, s=cfg.seq_len, h=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                        ffn_hidden=cfg.ffn_hidden, mlp=cfg.mlp)
    if cfg.moe is None or not cfg.moe.is_moe_layer(layer):
        return dense
    mlp = (6 if cfg.mlp == "swiglu" else 4) * B * cfg.seq_len * cfg.hidden * cfg.ffn_hidden
    return dense - mlp + moe_ffn_forward_flops(cfg, B=B)


def moe_ffn_forward_flops(cfg: GPTConfig, *, B: int) -> int:
    """Forward FLOPs of one MoE FFN for ``B`` sequences: the router ``2 B s h E``, each token's ``k``
    experts and the shared experts at their widths (SwiGLU ``6 B s h f``, GeLU ``4 B s h f`` each)."""
    moe, tokens, h = cfg.moe, B * cfg.seq_len, cfg.hidden
    f = moe.expert_ffn(cfg.ffn_hidden)
    per_width = (6 if cfg.mlp == "swiglu" else 4) * tokens * h
    return 2 * tokens * h * moe.experts + per_width * f * (moe.top_k + moe.shared_experts)


def config_core_forward_flops(cfg: GPTConfig, *, B: int) -> int:
    """Forward FLOPs of one layer's attention core of ``cfg`` (what selective recompute repeats)."""
    return attention_core_forward_flops(B=B, s=cfg.seq_len, h=cfg.hidden)


def _config_parts(cfg: GPTConfig, B: int, t: int) -> tuple[int, int, int]:
    """(layer forward, attention-core forward, logits forward) FLOPs of ``cfg`` at TP size ``t``."""
    logits = logits_forward_flops(B=B, s=cfg.seq_len, h=cfg.hidden, v=cfg.padded_vocab(t))
    return config_layer_forward_flops(cfg, B=B), config_core_forward_flops(cfg, B=B), logits


def config_model_flops(cfg: GPTConfig, *, B: int, t: int = 1) -> int:
    """Model FLOPs per iteration of ``cfg`` (forward + backward, no recompute) for ``B`` sequences
    of ``cfg.seq_len`` tokens: 3 x (L x layer forward + logits), the logits over the vocabulary
    padded for TP size ``t``. The whole model's: each of ``t`` ranks executes ``1/t`` of it."""
    _, _, logits = _config_parts(cfg, B, t)
    return 3 * (layers_forward_flops(cfg, B=B) + logits)


def layers_forward_flops(cfg: GPTConfig, *, B: int) -> int:
    """Forward FLOPs of all ``cfg.layers`` layers for ``B`` sequences: the dense layers' and the MoE
    layers' (:func:`config_layer_forward_flops`), each kind counted once and multiplied."""
    n_moe = cfg.moe.moe_layer_count(cfg.layers) if cfg.moe is not None else 0
    dense = decoder_layer_forward_flops(B=B, s=cfg.seq_len, h=cfg.hidden, heads=cfg.heads, kv_heads=cfg.kv_heads,
                                        ffn_hidden=cfg.ffn_hidden, mlp=cfg.mlp)
    if not n_moe:
        return cfg.layers * dense
    moe_layer = next(i for i in range(cfg.layers) if cfg.moe.is_moe_layer(i))
    return (cfg.layers - n_moe) * dense + n_moe * config_layer_forward_flops(cfg, B=B, layer=moe_layer)


def config_hardware_flops(cfg: GPTConfig, *, B: int, t: int = 1, recompute: Recompute | None = None) -> int:
    """FLOPs executed per iteration, recomputation included (``recompute`` defaults to
    ``cfg.recompute``, or its per-layer ``recompute_layers``): selective adds one forward of every
    attention core, full one forward of every layer its runs checkpoint (``recompute_method`` /
    ``recompute_num_layers``). This
    counts what runs, as ``FlopCounterMode`` does; :func:`hardware_flops` keeps Appendix A's
    accounting, which charges the selective recompute three core forwards."""
    mode = cfg.recompute if recompute is None else recompute
    layer, core, _ = _config_parts(cfg, B, t)
    base = config_model_flops(cfg, B=B, t=t)
    modes = cfg.layer_recompute() if recompute is None else None  # model.recompute_layers
    if modes is not None:
        return base + core * modes.count("selective") + sum(
            config_layer_forward_flops(cfg, B=B, layer=i) for i, m in enumerate(modes) if m == "full")
    if mode == "none":
        return base
    if mode == "selective":
        return base + cfg.layers * core
    if mode == "full":
        runs = checkpoint_runs(cfg.layers, cfg.recompute_method, cfg.recompute_num_layers)
        return base + sum(config_layer_forward_flops(cfg, B=B, layer=i)
                          for begin, end, ckpt in runs if ckpt for i in range(begin, end))
    raise ValueError(f"unknown recompute mode {mode!r}; expected one of {RECOMPUTE_MODES}")


def step_model_flops(cfg: GPTConfig, *, sequences: int, t: int = 1) -> int:
    """Model FLOPs of one optimizer step over ``sequences`` sequences of ``cfg.seq_len`` tokens (all
    ranks together), what MFU divides by: :func:`config_model_flops` with the model's real shape
    (grouped-query attention, SwiGLU, ``ffn_hidden``, the vocabulary padded for TP size ``t``);
    recomputation is not counted."""
    return config_model_flops(cfg, B=sequences, t=t)


def selective_overhead(s: int, h: int) -> float:
    """Extra FLOPs of selective recompute as a fraction of a layer's model FLOPs: (s/(6h)) / (1 + s/(6h)).

    This is Appendix A's accounting (hardware minus model FLOPs of a layer, 12Bs^2h, over the
    layer's model FLOPs 72Bsh^2 + 12Bs^2h) and reproduces §5's quoted figures: 2.70% for GPT-3
    (s=2048, h=12288) and 1.64% for MT-NLG (h=20480), quoted as 2.7% and 1.6%. Adding the logits
    to the denominator gives 2.69% and 1.64%, the same after rounding. Charging only the
    recomputed forward, 4Bs^2h, would give s/(18h + 3s): 0.90% and 0.55%, which does not match.
    """
    r = s / (6 * h)
    return r / (1 + r)


def mfu(model_flops_per_iter: float, seconds: float, peak_flops_per_device: float, n_devices: int = 1) -> float:
    """Model FLOPs utilisation: model FLOPs / iteration time / (peak FLOP/s x devices), in [0, 1]."""
    if seconds <= 0 or peak_flops_per_device <= 0 or n_devices < 1:
        raise ValueError(
            f"need seconds > 0, peak > 0, n_devices >= 1; got {seconds}, {peak_flops_per_device}, {n_devices}"
        )
    return model_flops_per_iter / seconds / (peak_flops_per_device * n_devices)


def hfu(hardware_flops_per_iter: float, seconds: float, peak_flops_per_device: float, n_devices: int = 1) -> float:
    """Hardware FLOPs utilisation: as :func:`mfu` but counting recomputed FLOPs too."""
    return mfu(hardware_flops_per_iter, seconds, peak_flops_per_device, n_devices)


# Peak dense bf16 tensor-core FLOP/s per device (vendor datasheets, no sparsity). Matched as a
# case-insensitive substring of the device name, in order: more specific names first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("a100", 312e12),
    ("a800", 312e12),
    ("h100 pcie", 756e12),
    ("h100 nvl", 835e12),
    ("h100", 989e12),  # SXM
    ("h800", 989e12),
    ("h200 nvl", 835e12),
    ("h200", 989e12),  # SXM; also matches GH200
    ("b200", 2250e12),
    ("l40s", 362e12),
    ("mi300x", 1307e12),
)


PEAK_ENV = "SEQPAR_PEAK_TFLOPS"  # overrides the table: peak dense TFLOP/s of one device


def peak_flops(device_name: str) -> float | None:
    """Peak dense bf16 FLOP/s for a device name such as ``torch.cuda.get_device_name()``.

    ``"NVIDIA A100-SXM4-80GB"`` -> 312e12; ``"NVIDIA H200"`` (SXM) -> 989e12; ``"NVIDIA H200 NVL"``
    -> 835e12. ``$SEQPAR_PEAK_TFLOPS`` (e.g. ``800``) overrides the table for any device. None
    for CPUs and devices not in :data:`PEAK_BF16_FLOPS`.
    """
    override = os.environ.get(PEAK_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value <= 0:
            raise UserError(f"{PEAK_ENV} must be a positive number of TFLOP/s, got {override!r}")
        return value * 1e12
    name = device_name.lower()
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak
    return None
