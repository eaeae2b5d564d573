"""Activation-memory formulas of Korthikanti et al. 2022 (Table 2, §4.2.3, §4.3), in bytes.

Notation: s sequence length, b micro-batch, h hidden size, a attention heads, t tensor-parallel
size, p pipeline size, m interleaved model chunks per pipeline stage, L layers, v vocabulary.
Activations are 16-bit (2 bytes per element), dropout masks 1 byte per element; LayerNorm
statistics and other small buffers are ignored, as in the paper.

Everything is computed with exact rationals and returned as an ``int`` when the byte count is
whole, else a ``float``; the formulas themselves are pure Python. ``load_shape`` reads a run
config's ``model`` / ``parallel`` / ``train`` sections through the strict config loader.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, get_args

from .. import config
from ..config import ParallelConfig, TrainConfig, resolve_config, shipped_dir
from ..model.config import GPTConfig

Technique = Literal["none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full"]
TECHNIQUES: tuple[Technique, ...] = get_args(Technique)
Number = int | float
GIB = 2**30

# Table 2 breakdown for one layer without parallelism, as multiples of sbh (or as^2b for the
# attention-score terms). Sharding under plain TP: "rep" stays whole on every TP rank, "tp" is
# split across ranks (by heads or by the MLP's 4h columns). Under TP+SP every term is split.
_SBH_TERMS: dict[str, tuple[int, str]] = {
    "layernorm_inputs": (4, "rep"),  # inputs of the two LayerNorms, 2 x 2sbh
    "qkv_input": (2, "rep"),  # input of the fused QKV projection
    "qk": (4, "tp"),  # Q and K, kept for QK^T backward
    "v": (2, "tp"),  # V, kept for attention-over-V backward
    "proj_input": (2, "tp"),  # input of the attention output projection
    "attn_dropout_mask": (1, "rep"),  # post-attention dropout mask
    "fc1_input": (2, "rep"),  # input of the h -> 4h linear
    "gelu_input": (8, "tp"),  # [s, b, 4h]
    "fc2_input": (8, "tp"),  # GeLU output, input of the 4h -> h linear
    "mlp_dropout_mask": (1, "rep"),  # post-MLP dropout mask
}
_SCORE_TERMS: dict[str, int] = {  # [b, a, s, s] tensors, split by heads under TP
    "softmax_out": 2,
    "softmax_dropout_mask": 1,
    "softmax_dropout_out": 2,
}
SELECTIVE_DROPPED: tuple[str, ...] = tuple(_SCORE_TERMS)  # recomputed under selective recompute


def _out(x: Fraction) -> Number:
    return int(x) if x.denominator == 1 else float(x)


def _check_dims(**dims: int) -> None:
    bad = {k: v for k, v in dims.items() if not isinstance(v, int) or v < 1}
    if bad:
        raise ValueError(f"dimensions must be positive ints, got {bad}")


def _check(technique: str, **dims: int) -> None:
    if technique not in TECHNIQUES:
        raise ValueError(f"unknown technique {technique!r}; expected one of {TECHNIQUES}")
    _check_dims(**dims)


def activation_breakdown(technique: Technique, *, s: int, b: int, h: int, a: int, t: int = 1) -> dict[str, Number]:
    """Bytes per layer of each stored activation (names as in Table 2's derivation) for one GPU.

    ``"tp"`` divides only the head/column-split terms by ``t``; ``"tp_sp"`` divides all terms by
    ``t``; the ``*_selective`` variants drop the softmax output, its dropout mask and the dropout
    output (recomputed in backward); ``"full"`` keeps only the layer input ``{"layer_input": 2sbh}``.
    ``t`` is ignored for ``"none"`` (one device) and ``"full"`` (Table 2's 2sbh row).
    """
    _check(technique, s=s, b=b, h=h, a=a, t=t)
    sbh = s * b * h
    if technique == "full":
        return {"layer_input": 2 * sbh}
    tt = 1 if technique == "none" else t
    sp = technique in ("tp_sp", "tp_sp_selective")
    terms: dict[str, Fraction] = {}
    for name, (k, shard) in _SBH_TERMS.items():
        terms[name] = Fraction(k * sbh, tt if (shard == "tp" or sp) else 1)
    if not technique.endswith("selective"):
        for name, k in _SCORE_TERMS.items():
            terms[name] = Fraction(k * a * s * s * b, tt)
    return {name: _out(x) for name, x in terms.items()}


def _per_layer(technique: Technique, s: int, b: int, h: int, a: int, t: int) -> Fraction:
    sbh, r = Fraction(s * b * h), Fraction(5 * a * s, h)  # r = 5as/h
    rows: dict[str, Fraction] = {
        "none": sbh * (34 + r),
        "tp": sbh * (10 + Fraction(24, t) + r / t),
        "tp_sp": sbh / t * (34 + r),
        "tp_selective": sbh * (10 + Fraction(24, t)),
        "tp_sp_selective": 34 * sbh / t,
        "full": 2 * sbh,
    }
    return rows[technique]


def bytes_per_layer(technique: Technique, *, s: int, b: int, h: int, a: int, t: int = 1) -> Number:
    """Activation bytes one transformer layer stores per GPU: the closed forms of Table 2.

    none: sbh(34 + 5as/h); tp: sbh(10 + 24/t + 5as/(ht)); tp_sp: (sbh/t)(34 + 5as/h);
    tp_selective: sbh(10 + 24/t); tp_sp_selective: 34sbh/t; full: 2sbh.
    """
    _check(technique, s=s, b=b, h=h, a=a, t=t)
    return _out(_per_layer(technique, s, b, h, a, t))


def ratio_to_tp(technique: Technique, *, s: int, b: int, h: int, a: int, t: int) -> float:
    """Per-layer bytes of ``technique`` over the TP baseline (Figure 7's bars, as a fraction)."""
    _check(technique, s=s, b=b, h=h, a=a, t=t)
    return float(_per_layer(technique, s, b, h, a, t) / _per_layer("tp", s, b, h, a, t))


def attention_score_share(*, s: int, h: int, a: int) -> float:
    """Share of a layer's activations (no parallelism) in the [b, a, s, s] terms: (5as/h)/(34 + 5as/h).

    §5: 5as/h = 80 for GPT-3 and 64 for MT-NLG, i.e. about 70% and 65% of the memory.
    """
    r = Fraction(5 * a * s, h)
    return float(r / (34 + r))


def _interleave(p: int, m: int) -> Fraction:
    if p < 1 or m < 1:
        raise ValueError(f"pipeline size p and chunks m must be >= 1, got p={p}, m={m}")
    return Fraction(1) if m == 1 else 1 + Fraction(p - 1, p * m)


def interleave_factor(p: int, m: int = 1) -> float:
    """Extra first-stage memory of the interleaved schedule, 1 + (p-1)/(pm) (§4.2.3).

    ``m == 1`` means the plain (non-interleaved) 1F1B schedule: factor 1.
    """
    return float(_interleave(p, m))


def first_stage_bytes(per_layer: Number, *, L: int, p: int, m: int = 1) -> Number:
    """Activation bytes on the first pipeline stage, which the 1F1B schedule makes the peak.

    It holds L/p layers for p in-flight micro-batches, i.e. L layers' worth, times
    :func:`interleave_factor` for the interleaved schedule: per_layer * L * (1 + (p-1)/(pm)).
    """
    return _out(Fraction(per_layer) * L * _interleave(p, m))


def extra_bytes(*, s: int, b: int, h: int, v: int, t: int, p: int) -> dict[str, Number]:
    """Activations outside the transformer layers (§4.3), per GPU, in bytes.

    The embedding dropout mask (sbhp/t, on the first stage for p in-flight micro-batches) and,
    only on the stage holding the output layer, the final LayerNorm input (2sbh/t), the output
    layer input (2sbh/t) and the fp32 logits for the cross-entropy (4sbv/t).
    """
    _check_dims(s=s, b=b, h=h, v=v, t=t, p=p)
    sbh = s * b * h
    return {
        "embedding_dropout_mask": _out(Fraction(sbh * p, t)),
        "final_layernorm_input": _out(Fraction(2 * sbh, t)),
        "output_layer_input": _out(Fraction(2 * sbh, t)),
        "logits_fp32": _out(Fraction(4 * s * b * v, t)),
    }


@dataclass(frozen=True)
class ModelShape:
    """A GPT model and its parallel layout, as a row of Table 3."""

    name: str
    s: int  # sequence length
    b: int  # micro-batch size
    h: int  # hidden size
    a: int  # attention heads
    L: int  # transformer layers
    v: int  # vocabulary size
    t: int  # tensor-parallel size
    p: int = 1  # pipeline-parallel size
    m: int = 1  # interleaved model chunks per pipeline stage (1 = plain 1F1B)

    def __post_init__(self) -> None:
        dims = {k: getattr(self, k) for k in ("s", "b", "h", "a", "L", "v", "t", "p", "m")}
        bad = {k: x for k, x in dims.items() if not isinstance(x, int) or x < 1}
        if bad:
            raise ValueError(f"ModelShape {self.name!r}: dimensions must be positive ints, got {bad}")
        if self.h % self.a:
            raise ValueError(f"ModelShape {self.name!r}: hidden {self.h} not divisible by heads {self.a}")


def per_gpu_bytes(shape: ModelShape, technique: Technique) -> Number:
    """Peak activation bytes per GPU (Figure 1): Table 2's per-layer bytes x L x interleave factor.

    The §4.3 terms outside the layers are left out, as for the paper's Figure 1 and Figure 7.
    """
    _check(technique, s=shape.s, b=shape.b, h=shape.h, a=shape.a, t=shape.t)
    per_layer = _per_layer(technique, shape.s, shape.b, shape.h, shape.a, shape.t)
    return _out(per_layer * shape.L * _interleave(shape.p, shape.m))


def gib(n_bytes: Number) -> float:
    """Bytes to GiB (2**30 bytes)."""
    return float(Fraction(n_bytes) / GIB)


# keys a config must set itself for the formulas (a default vocabulary or batch would mislead)
SHAPE_KEYS = {"model": ("seq_len", "hidden", "heads", "layers", "vocab_size"), "train": ("micro_batch",)}


def load_sections(path: str | Path) -> tuple[Path, dict]:
    """The resolved path and the ``model`` / ``parallel`` / ``train`` sections of a run config.

    ``path`` is a YAML file or a shipped config's name (``paper/175b``). Each section is checked by
    the strict loader (unknown keys and wrong types name the dotted key); other sections are ignored.
    """
    path = resolve_config(path)
    schema = {"model": GPTConfig, "parallel": ParallelConfig, "train": TrainConfig}
    return path, config.load_sections(path, schema, SHAPE_KEYS)


def shape_of(name: str, sections: dict) -> ModelShape:
    """The ``ModelShape`` of the sections returned by :func:`load_sections`."""
    model, par, train = sections["model"], sections["parallel"], sections["train"]
    return ModelShape(name=name, s=model.seq_len, b=train.micro_batch, h=model.hidden, a=model.heads,
                      L=model.layers, v=model.vocab_size, t=par.tp, p=par.pp, m=par.virtual_stages)


def load_shape(path: str | Path) -> ModelShape:
    """Read a ``ModelShape`` from a run config (``model``, ``parallel``, ``train`` sections).

    The name is the file stem upper-cased (``configs/paper/175b.yaml`` -> ``"175B"``).
    """
    path, sections = load_sections(path)
    return shape_of(path.stem.upper(), sections)


PAPER_MODELS: tuple[str, ...] = ("22b", "175b", "530b", "1t")


def paper_config_dir() -> Path:
    """The shipped ``configs/paper`` directory (package data, present in an installed wheel too)."""
    return shipped_dir() / "paper"


def paper_shapes() -> dict[str, ModelShape]:
    """The four Table 3 models keyed by name ("22B", "175B", "530B", "1T"), from configs/paper."""
    shapes = [load_shape(paper_config_dir() / f"{n}.yaml") for n in PAPER_MODELS]
    return {s.name: s for s in shapes}
