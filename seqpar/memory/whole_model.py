"""Activation bytes of a whole model at a given config: what one rank keeps for backward.

Table 2 counts every layer's activations for 16-bit tensors with dropout everywhere. A real run
differs in ways the paper's derivation already names, and this module applies them term by term:
dropout off keeps no masks (and with attention dropout off the softmax output is also the
dropout output); fp32 activations take 4 bytes where Table 2 counts 2; full recompute keeps one
input per checkpointed unit of layers; and the §4.3 terms outside the layers (embedding dropout
mask, final LayerNorm input, output-layer input, and what the loss keeps: the logits in their own
dtype and 8 bytes per token) are added. A per-layer list
(``model.recompute_layers``) sums each layer's own mode, a full layer keeping its input. LayerNorm
statistics and integer token ids are small and left out, as in the paper.

The Llama family generalises three terms (derivation in ``docs/memory.md``): RMSNorm keeps its
input like LayerNorm (only the small per-token statistics differ: no mean); grouped-query
attention keeps K and V of ``g`` heads, ``2sbh g/a`` each; SwiGLU keeps the fused gate and up
(``4sbf``) where GeLU keeps its input (``2sbf``), and both keep the fc2 input (``2sbf``), with
the MLP width ``f`` from the config. RoPE adds nothing: it runs outside the selectively
recomputed region and returns the Q, K, V that attention keeps anyway. The logits have the
padded vocabulary's columns. What the attention core keeps depends on its kernel
(:func:`attention_kernel`; ``docs/memory.md``, "Per attention kernel").

Context parallelism (``cp``): every term is one CP rank's ``s/cp`` tokens, and the context-parallel
attention kernel (:mod:`seqpar.model.context_attention`) keeps, in every mode but full, Table 2's
selective terms (its q, k, v and output) plus its fp32 log-sum-exp ``[b, a/t, s/cp]``; backward
exchanges K/V again, so nothing of the other ranks' K/V is kept (``docs/context-parallel.md``).
"""
from __future__ import annotations

from collections import Counter
from fractions import Fraction
from typing import Sequence

from ..model.config import GPTConfig
from ..model.modes import resolve_attention
from ..recompute import checkpoint_runs
from ..model.recompute_ops import DROPPED_TERMS
from .formulas import _SCORE_TERMS, _sbh_terms, outside_layer_terms
from .moe import moe_ffn_terms


# PyTorch's order of preference among the CUDA kernels of ``scaled_dot_product_attention`` (its default
# ``torch._C._get_sdp_priority_order()``); "efficient" is the memory-efficient kernel
CUDA_SDPA_ORDER: tuple[str, ...] = ("flash", "efficient", "math", "cudnn")
FLASH_MAX_HEAD_DIM = 256  # flash attention on sm80 / sm90 (A100, H100, H200), forward and backward


def cuda_sdpa_kernel(*, dtype_bytes: int, heads: int, kv_heads: int, head_dim: int,
                     order: Sequence[str] = CUDA_SDPA_ORDER) -> str:
    """The kernel ``scaled_dot_product_attention`` runs on an sm80 / sm90 GPU (the planner's A100,
    H100, H200) for one rank's ``heads`` query and ``kv_heads`` key/value heads of ``head_dim``,
    ``dtype_bytes``-byte inputs, causal, no mask, grad on: the first of ``order`` (PyTorch's
    preference, less what an ``sdpa_kernel`` context disables) whose checks pass. ``flash``: 2-byte
    inputs, head dim <= 256, grouped heads too; ``efficient``: 2- or 4-byte inputs, head dim a
    multiple of 16 bytes' worth of elements, equal head counts; ``cudnn``: 2-byte inputs, head dim
    <= 128 and a multiple of 8, equal head counts; ``math``: anything (``"none"`` when ``order``
    holds nothing that takes them)."""
    half, grouped = dtype_bytes == 2, heads != kv_heads
    takes = {"flash": half and head_dim <= FLASH_MAX_HEAD_DIM,
             "efficient": dtype_bytes in (2, 4) and head_dim % (16 // dtype_bytes) == 0 and not grouped,
             "cudnn": half and head_dim <= 128 and head_dim % 8 == 0 and not grouped, "math": True}
    return next((k for k in order if takes.get(k, False)), "none")


def attention_kernel(cfg: GPTConfig, device: str = "cuda", *, t: int = 1, act: int = 2) -> str:
    """What the attention core runs as, for the memory it keeps (``docs/memory.md``), at TP size
    ``t`` with ``act``-byte activations: ``"math"`` (seqpar's own, Table 2's ``[b, a, s, s]``
    terms); ``"fused"`` (``attention: sdpa`` where it runs a fused kernel: CUDA's flash /
    memory-efficient / cuDNN (:func:`cuda_sdpa_kernel`), CPU's flash without attention dropout:
    output, logsumexp and RNG state, O(s) per head); ``"sdpa-math"`` (``sdpa`` falling back to
    PyTorch's composite math kernel, which computes in fp32: on CPU with attention dropout, on
    CUDA for fp32 with grouped-query heads)."""
    if resolve_attention(cfg.attention, device) == "math":  # auto: math off CUDA
        return "math"
    if device == "cpu":
        return "sdpa-math" if cfg.attention_dropout > 0 else "fused"
    return "sdpa-math" if cuda_sdpa_kernel(**_sdpa_shape(cfg, t, act)) == "math" else "fused"


def _sdpa_shape(cfg: GPTConfig, t: int, act: int) -> dict[str, int]:
    """:func:`cuda_sdpa_kernel`'s arguments for one of ``t`` TP ranks at ``act``-byte activations."""
    return dict(dtype_bytes=act, heads=cfg.heads // t, kv_heads=cfg.held_kv_heads(t) // t, head_dim=cfg.head_dim)


def _core_terms(cfg: GPTConfig, kernel: str, *, sbh: Fraction, scores: Fraction, t: int, u: Fraction,
                device: str) -> dict[str, Fraction]:
    """What the attention core keeps when it is not recomputed, beyond Table 2's Q, K, V
    (``sdpa-math`` replaces those); ``scores`` = a s^2 b elements, ``u`` = activation bytes / 2."""
    dropout = cfg.attention_dropout > 0
    if kernel == "fused":  # fp32 logsumexp [b, a, s]; with dropout the philox seed and offset (2 x int64)
        out = {"attention_logsumexp": 4 * cfg.heads * (sbh / cfg.hidden) / t}
        if dropout and device != "cpu":
            out["attention_rng_state"] = Fraction(16)
        return out
    if kernel == "sdpa-math":  # fp32 Q and K, V at all a heads; fp32 softmax, with dropout its mask and output
        out = {"qk": 8 * sbh / t, "v": 4 * sbh / t, "softmax_out": 4 * scores / t}
        if dropout:  # the CPU's dropout keeps a mask of the scores' dtype, CUDA's fused one a 1-byte mask
            out["softmax_dropout_mask"] = (4 if device == "cpu" else 1) * scores / t
            out["softmax_dropout_out"] = 4 * scores / t
        return out
    out = {}
    for name, k in _SCORE_TERMS.items():
        if name == "softmax_out" or dropout:
            out[name] = k * scores * (1 if name.endswith("mask") else u) / t
    return out


def _output_copy(cfg: GPTConfig, *, sbh: Fraction, b: int, t: int, act: int, device: str) -> dict[str, Fraction]:
    """CUDA's memory-efficient kernel writes its output ``[b, s, a, d]`` whatever the query's layout
    (flash and cuDNN follow the query's ``[s, b, a, d]``); at ``b > 1`` the projection's matmul takes
    a ``[s b, h/t]`` copy of it, and the kernel keeps the output too."""
    if device == "cpu" or b == 1 or cuda_sdpa_kernel(**_sdpa_shape(cfg, t, act)) != "efficient":
        return {}
    return {"attention_output": sbh * act / t}


def layer_terms(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, selective: bool,
                device: str = "cuda", cp: int = 1, moe: bool = False, ep: int = 1) -> dict[str, Fraction]:
    """One layer's kept tensors in bytes as this config runs it on ``device``: Table 2's terms
    (:func:`seqpar.memory.formulas.activation_breakdown`'s names) at ``act``-byte activations, the
    dropout masks (1 byte) only with dropout; without selective recompute, what the attention
    kernel (:func:`attention_kernel`) keeps: for math the ``[b, a, s, s]`` terms (the softmax-dropout
    ones only with attention dropout). ``cp > 1``: ``s`` is one CP rank's tokens and the core is
    the context-parallel kernel's (Table 2's selective terms and the log-sum-exp, in any mode).
    ``moe``: an MoE layer, whose FFN keeps :func:`seqpar.memory.moe.moe_ffn_terms` instead of the
    MLP's fc1 input, activation input and fc2 input, over ``ep`` expert-parallel ranks (an even
    load: each rank receives as many rows as it sends). ``cfg.recompute_ops`` leave out the terms
    those choices rebuild in backward (:data:`seqpar.model.recompute_ops.DROPPED_TERMS`)."""
    sbh, scores = Fraction(s * b * cfg.hidden), Fraction(cfg.heads * s * s * b)
    rep = t if cfg.sequence_parallel else 1  # the terms plain TP leaves replicated: SP splits them too
    u = Fraction(act, 2)  # Table 2 counts 2-byte activations
    terms: dict[str, Fraction] = {}
    for name, (k, shard) in _sbh_terms(cfg.hidden, cfg.heads, cfg.held_kv_heads(t), cfg.ffn_hidden, cfg.mlp).items():
        if name.endswith("dropout_mask"):
            if cfg.dropout > 0:
                terms[name] = k * sbh / rep
        else:
            terms[name] = k * sbh * u / (t if shard == "tp" else rep)
    for op in cfg.recompute_ops:  # model.recompute_ops: rebuilt in backward, not kept
        for name in DROPPED_TERMS[op]:
            terms.pop(name, None)
    if moe:
        for name in ("fc1_input", "gelu_input", "swiglu_gate_up", "fc2_input"):
            terms.pop(name, None)
        terms.update(moe_ffn_terms(cfg, s=s, b=b, t=t, act=act, ep=ep, device=device))
    if cp > 1:  # fp32 log-sum-exp [b, a/t, s/cp]; no s x s term in any mode
        terms["attention_logsumexp"] = 4 * cfg.heads * (sbh / cfg.hidden) / t
    elif not selective:
        kernel = attention_kernel(cfg, device, t=t, act=act)
        terms.update(_core_terms(cfg, kernel, sbh=sbh, scores=scores, t=t, u=u, device=device))
        if kernel == "fused":
            terms.update(_output_copy(cfg, sbh=sbh, b=b, t=t, act=act, device=device))
    return terms


def outside_terms(cfg: GPTConfig, *, s: int, b: int, t: int, act: int, in_flight: int = 1, first: bool = True,
                  last: bool = True) -> dict[str, Fraction]:
    """§4.3 as this config runs it (:func:`seqpar.memory.formulas.outside_layer_terms`): the
    logits have the padded vocabulary's columns; no embedding mask without dropout."""
    return outside_layer_terms(s=s, b=b, h=cfg.hidden, v=cfg.padded_vocab(t), t=t,
                                rep=t if cfg.sequence_parallel else 1, act=act, dropout=cfg.dropout > 0,
                                in_flight=in_flight, first=first, last=last)


def layer_bytes(cfg: GPTConfig, mode: str, *, s: int, b: int, t: int, act: int, device: str = "cuda",
                cp: int = 1, moe: bool = False, ep: int = 1) -> Fraction:
    """Bytes one layer of ``cfg`` keeps for one micro-batch under recompute ``mode`` on ``device``;
    ``full``: the input of a checkpointed unit (one per unit, however many layers it holds).
    ``cp``: context parallelism, ``s`` being one CP rank's tokens; ``ep``: expert parallelism."""
    if mode == "full":
        return Fraction(s * b * cfg.hidden * act, t if cfg.sequence_parallel else 1)
    terms = layer_terms(cfg, s=s, b=b, t=t, act=act, selective=mode == "selective", device=device, cp=cp, moe=moe,
                        ep=ep)
    return sum(terms.values(), Fraction(0))


def model_activation_bytes(cfg: GPTConfig, *, t: int, micro_batch: int, activation_bytes: int = 2,
                           seq_len: int | None = None, device: str = "cuda", cp: int = 1) -> dict[str, int]:
    """Bytes one rank keeps for backward for one micro-batch of ``cfg`` at TP size ``t`` on a
    ``device`` ("cuda" or "cpu": the attention kernel sdpa picks): ``{"layers": ..., "outside_layers":
    ..., "total": ...}``. ``activation_bytes``: 2 for bf16 activations, 4 for fp32 (dropout masks stay
    1 byte). ``cp``: per CP rank under context parallelism (``s/cp`` tokens of each sequence)."""
    dims = dict(s=(seq_len or cfg.seq_len) // cp, b=micro_batch, t=t, act=activation_bytes)
    per = dict(dims, device=device, cp=cp)
    moe = [cfg.moe is not None and cfg.moe.is_moe_layer(i) for i in range(cfg.layers)]
    modes = cfg.layer_recompute()  # model.recompute_layers: one mode per layer, each full layer its own unit
    if modes is not None:
        kinds = Counter(zip(modes, moe))
    elif cfg.recompute == "full":
        runs = checkpoint_runs(cfg.layers, cfg.recompute_method, cfg.recompute_num_layers)
        kinds = Counter(("none", moe[i]) for begin, end, ckpt in runs if not ckpt for i in range(begin, end))
        kinds["full", False] += sum(1 for *_, ckpt in runs if ckpt)  # one unit input per checkpointed unit
    else:
        kinds = Counter((cfg.recompute, e) for e in moe)
    # layers of one kind keep the same bytes: one formula per kind (a million-layer config stays instant)
    layers = sum(n * layer_bytes(cfg, m, **per, moe=e) for (m, e), n in kinds.items())
    outside = sum(outside_terms(cfg, **dims).values())
    return {"layers": round(layers), "outside_layers": round(outside), "total": round(layers + outside)}


__all__ = ["attention_kernel", "layer_bytes", "layer_terms", "model_activation_bytes", "outside_terms"]
