"""Activation-memory formulas of Korthikanti et al. 2022 (Table 2, §4.2.3, §4.3), in bytes.

Notation: s sequence length, b micro-batch, h hidden size, a attention heads, t tensor-parallel
size, p pipeline size, m interleaved model chunks per pipeline stage, L layers, v vocabulary.
Activations are 16-bit (2 bytes per element), dropout masks 1 byte per element; LayerNorm
statistics and other small buffers are ignored, as in the paper.

Everything is computed with exact rationals and returned as an ``int`` when the byte count is
whole, else a ``float``; the formulas themselves are pure Python. ``load_shape`` reads a run
config's ``model`` / ``parallel`` / ``train`` sections through the strict config loader.

Llama-family layers (``docs/memory.md``): the per-layer functions take ``kv_heads`` (g, grouped-
query attention: K and V of g heads), ``ffn_hidden`` (f, default 4h) and ``mlp`` ("gelu" or
"swiglu"). Writing ``c = 4 + 4g/a + m f/h`` with ``m = 4`` (GeLU input + fc2 input) or ``m = 6``
(SwiGLU gate and up + fc2 input), Table 2's ``24`` becomes ``c`` and its ``34`` becomes ``10 + c``:
GPT (g = a, f = 4h, GeLU) gives back 24 and 34. RMSNorm keeps the same input as LayerNorm.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Literal, Sequence, get_args

from .. import config
from ..config import ParallelConfig, TrainConfig, resolve_config, shipped_dir
from ..model.config import GPTConfig
from ..model.recompute_ops import DROPPED_TERMS, check_recompute_ops
from .schedule import interleave_factor as _interleave

Technique = Literal["none", "tp", "tp_sp", "tp_selective", "tp_sp_selective", "full"]
TECHNIQUES: tuple[Technique, ...] = get_args(Technique)
Number = int | float
GIB = 2**30

# Table 2's breakdown of one layer without parallelism is :func:`_sbh_terms`, in multiples of sbh
# (or as^2b for the attention-score terms below). Sharding under plain TP: "rep" stays whole on
# every TP rank, "tp" is split across ranks (by heads or by the MLP's columns). Under TP+SP every
# term is split.
_SCORE_TERMS: dict[str, int] = {  # [b, a, s, s] tensors, split by heads under TP
    "softmax_out": 2,
    "softmax_dropout_mask": 1,
    "softmax_dropout_out": 2,
}
SELECTIVE_DROPPED: tuple[str, ...] = tuple(_SCORE_TERMS)  # recomputed under selective recompute
Mlp = Literal["gelu", "swiglu"]


def _sbh_terms(h: int, a: int, kv_heads: int | None, ffn_hidden: int | None,
               mlp: str) -> dict[str, tuple[Fraction, str]]:
    """Name -> (multiple of sbh, "rep" | "tp") for ``g = kv_heads`` key/value heads, MLP width ``f``
    and ``mlp``. GPT: LayerNorm inputs 4, QKV input 2, Q and K 4, V 2, projection input 2, dropout
    masks 1 + 1 (1 byte), fc1 input 2, GeLU input 8, fc2 input 8. In general Q 2 and K, V ``2g/a``
    each; GeLU input ``2f/h`` or SwiGLU's gate and up ``4f/h``; fc2 input ``2f/h``."""
    if mlp not in ("gelu", "swiglu"):
        raise ValueError(f"mlp must be 'gelu' or 'swiglu', got {mlp!r}")
    g, f = a if kv_heads is None else kv_heads, 4 * h if ffn_hidden is None else ffn_hidden
    _check_dims(kv_heads=g, ffn_hidden=f)
    if a % g:
        raise ValueError(f"kv_heads ({g}) must divide heads ({a})")
    kv, ffn, one = Fraction(g, a), Fraction(f, h), Fraction(1)
    act = ("swiglu_gate_up", 4 * ffn) if mlp == "swiglu" else ("gelu_input", 2 * ffn)
    return {"layernorm_inputs": (4 * one, "rep"), "qkv_input": (2 * one, "rep"), "qk": (2 + 2 * kv, "tp"),
            "v": (2 * kv, "tp"), "proj_input": (2 * one, "tp"), "attn_dropout_mask": (one, "rep"),
            "fc1_input": (2 * one, "rep"), act[0]: (act[1], "tp"), "fc2_input": (2 * ffn, "tp"),
            "mlp_dropout_mask": (one, "rep")}


def split_coefficient(*, h: int, a: int, kv_heads: int | None = None, ffn_hidden: int | None = None,
                      mlp: Mlp = "gelu") -> Fraction:
    """``c``, the multiple of ``sbh`` that TP splits by ``t`` (Table 2's 24 for GPT):
    ``4 + 4g/a + m f/h``, ``m = 4`` for GeLU, 6 for SwiGLU. The replicated part stays 10."""
    return sum((c for c, shard in _sbh_terms(h, a, kv_heads, ffn_hidden, mlp).values() if shard == "tp"), Fraction(0))


def recompute_op_coefficients(*, h: int, a: int, kv_heads: int | None = None, ffn_hidden: int | None = None,
                              mlp: Mlp = "gelu") -> dict[str, Fraction]:
    """The multiple of ``sbh`` (16-bit activations, 1-byte masks) each ``model.recompute_ops`` choice
    stops keeping (:data:`seqpar.model.recompute_ops.DROPPED_TERMS`): ``norm`` 4 (the QKV and fc1 inputs),
    ``activation`` ``2f/h`` (the fc2 input: 8 for GeLU at f = 4h), ``dropout`` 2 (two 1-byte masks).
    Under SP each is divided by ``t``; under plain TP only ``activation`` is (the others are
    replicated)."""
    terms = _sbh_terms(h, a, kv_heads, ffn_hidden, mlp)
    return {op: sum((terms[n][0] for n in names if n in terms), Fraction(0)) for op, names in DROPPED_TERMS.items()}


def _dropped(technique: str, ops: Sequence[str], sbh: int, t: int, *, h: int, a: int, kv_heads: int | None,
             ffn_hidden: int | None, mlp: str) -> Fraction:
    """Bytes per layer ``ops`` (``model.recompute_ops``) stop keeping under ``technique``."""
    ops = check_recompute_ops(ops, "recompute_ops")
    if ops and technique == "full":
        raise ValueError(f"recompute_ops {list(ops)} mean nothing with full recompute")
    layer = _sbh_terms(h, a, kv_heads, ffn_hidden, mlp)
    tt, sp = (1 if technique == "none" else t), technique in ("tp_sp", "tp_sp_selective")
    names = [n for op in ops for n in DROPPED_TERMS[op] if n in layer]
    return sum((layer[n][0] * sbh / (tt if (layer[n][1] == "tp" or sp) else 1) for n in names), Fraction(0))


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


def _held(technique: Technique, kv_heads: int | None, t: int) -> int | None:
    """The key/value heads the ``t`` ranks of a TP technique hold together: ``g``, or ``t`` when
    ``g < t`` (one head per rank, replicated over the ``t / g`` ranks that share it)."""
    if kv_heads is None or technique in ("none", "full"):
        return kv_heads
    return max(kv_heads, t)


def activation_breakdown(technique: Technique, *, s: int, b: int, h: int, a: int, t: int = 1,
                         kv_heads: int | None = None, ffn_hidden: int | None = None,
                         mlp: Mlp = "gelu", recompute_ops: Sequence[str] = ()) -> dict[str, Number]:
    """Bytes per layer of each stored activation (names as in Table 2's derivation) for one GPU.

    ``"tp"`` divides only the head/column-split terms by ``t``; ``"tp_sp"`` divides all terms by
    ``t``; the ``*_selective`` variants drop the softmax output, its dropout mask and the dropout
    output (recomputed in backward); ``"full"`` keeps only the layer input ``{"layer_input": 2sbh}``.
    ``t`` is ignored for ``"none"`` (one device) and ``"full"`` (Table 2's 2sbh row).
    ``kv_heads``, ``ffn_hidden``, ``mlp``: the Llama-family generalisation (module docstring);
    SwiGLU names ``swiglu_gate_up`` instead of ``gelu_input``. ``recompute_ops``: the terms of those
    ``model.recompute_ops`` choices are left out (:func:`recompute_op_coefficients`).
    """
    _check(technique, s=s, b=b, h=h, a=a, t=t)
    _dropped(technique, recompute_ops, 1, t, h=h, a=a, kv_heads=kv_heads, ffn_hidden=ffn_hidden, mlp=mlp)  # checks
    dropped = {n for op in recompute_ops for n in DROPPED_TERMS[op]}
    sbh = s * b * h
    layer = _sbh_terms(h, a, _held(technique, kv_heads, t), ffn_hidden, mlp)
    if technique == "full":
        return {"layer_input": 2 * sbh}
    tt = 1 if technique == "none" else t
    sp = technique in ("tp_sp", "tp_sp_selective")
    terms: dict[str, Fraction] = {}
    for name, (k, shard) in layer.items():
        if name not in dropped:
            terms[name] = k * sbh / (tt if (shard == "tp" or sp) else 1)
    if not technique.endswith("selective"):
        for name, k in _SCORE_TERMS.items():
            terms[name] = Fraction(k * a * s * s * b, tt)
    return {name: _out(x) for name, x in terms.items()}


def _per_layer(technique: Technique, s: int, b: int, h: int, a: int, t: int, c: Fraction = Fraction(24)) -> Fraction:
    sbh, r = Fraction(s * b * h), Fraction(5 * a * s, h)  # r = 5as/h; c = 24 for GPT
    rows: dict[str, Fraction] = {
        "none": sbh * (10 + c + r),
        "tp": sbh * (10 + c / t + r / t),
        "tp_sp": sbh / t * (10 + c + r),
        "tp_selective": sbh * (10 + c / t),
        "tp_sp_selective": (10 + c) * sbh / t,
        "full": 2 * sbh,
    }
    return rows[technique]


def bytes_per_layer(technique: Technique, *, s: int, b: int, h: int, a: int, t: int = 1, kv_heads: int | None = None,
                    ffn_hidden: int | None = None, mlp: Mlp = "gelu", recompute_ops: Sequence[str] = ()) -> Number:
    """Activation bytes one transformer layer stores per GPU: the closed forms of Table 2.

    none: sbh(34 + 5as/h); tp: sbh(10 + 24/t + 5as/(ht)); tp_sp: (sbh/t)(34 + 5as/h);
    tp_selective: sbh(10 + 24/t); tp_sp_selective: 34sbh/t; full: 2sbh. With ``kv_heads``,
    ``ffn_hidden`` or ``mlp="swiglu"``, 24 becomes :func:`split_coefficient` ``c`` and 34 ``10 + c``.
    ``recompute_ops`` (``model.recompute_ops``) subtract their :func:`recompute_op_coefficients`
    (under SP divided by ``t``): tp_sp_selective with all three is ``(34 - 14)sbh/t`` for GPT.
    """
    _check(technique, s=s, b=b, h=h, a=a, t=t)
    g = _held(technique, kv_heads, t)
    c = split_coefficient(h=h, a=a, kv_heads=g, ffn_hidden=ffn_hidden, mlp=mlp)
    dropped = _dropped(technique, recompute_ops, s * b * h, t, h=h, a=a, kv_heads=g, ffn_hidden=ffn_hidden, mlp=mlp)
    return _out(_per_layer(technique, s, b, h, a, t, c) - dropped)


def ratio_to_tp(technique: Technique, *, s: int, b: int, h: int, a: int, t: int, kv_heads: int | None = None,
                ffn_hidden: int | None = None, mlp: Mlp = "gelu") -> float:
    """Per-layer bytes of ``technique`` over the TP baseline (Figure 7's bars, as a fraction)."""
    _check(technique, s=s, b=b, h=h, a=a, t=t)
    c, tp = (split_coefficient(h=h, a=a, kv_heads=_held(x, kv_heads, t), ffn_hidden=ffn_hidden, mlp=mlp)
             for x in (technique, "tp"))
    return float(_per_layer(technique, s, b, h, a, t, c) / _per_layer("tp", s, b, h, a, t, tp))


def attention_score_share(*, s: int, h: int, a: int) -> float:
    """Share of a layer's activations (no parallelism) in the [b, a, s, s] terms: (5as/h)/(34 + 5as/h).

    §5: 5as/h = 80 for GPT-3 and 64 for MT-NLG, i.e. about 70% and 65% of the memory.
    """
    r = Fraction(5 * a * s, h)
    return float(r / (34 + r))


def interleave_factor(p: int, m: int = 1) -> float:
    """Extra first-stage memory of the interleaved schedule, 1 + (p-1)/(pm) (§4.2.3).

    ``m == 1`` means the plain (non-interleaved) 1F1B schedule: factor 1. The layers in flight of
    every stage and schedule: :mod:`seqpar.memory.schedule`.
    """
    return float(_interleave(p, m))


def first_stage_bytes(per_layer: Number, *, L: int, p: int, m: int = 1) -> Number:
    """Activation bytes on the first pipeline stage, which the 1F1B schedule makes the peak.

    It holds L/p layers for p in-flight micro-batches, i.e. L layers' worth, times
    :func:`interleave_factor` for the interleaved schedule: per_layer * L * (1 + (p-1)/(pm)).
    """
    return _out(Fraction(per_layer) * L * _interleave(p, m))


CrossEntropy = Literal["online", "paper"]  # what the loss keeps: seqpar's online log-sum-exp, or §4.3's


def cross_entropy_terms(*, s: int, b: int, v: int, t: int, act: int = 2,
                        kind: CrossEntropy = "online") -> dict[str, Fraction]:
    """Bytes the vocabulary-parallel cross-entropy keeps for backward on one rank, ``v`` the rows of
    the output layer (the padded vocabulary). ``online`` (seqpar's): the logits ``[s, b, v/t]`` in
    their own ``act``-byte dtype (``2sbv/t`` in bf16) and, per token, its fp32 log-sum-exp and int32
    target code (``8sb``). ``paper``: §4.3's fp32 logits ``4sbv/t``."""
    if kind == "paper":
        return {"logits_fp32": Fraction(4 * s * b * v, t)}
    if kind != "online":
        raise ValueError(f"cross-entropy kind must be 'online' or 'paper', got {kind!r}")
    return {"logits": Fraction(act * s * b * v, t), "loss_lse_and_targets": Fraction(8 * s * b)}


def outside_layer_terms(*, s: int, b: int, h: int, v: int, t: int, rep: int, act: int = 2, dropout: bool = True,
                        in_flight: int = 1, first: bool = True, last: bool = True,
                        cross_entropy: CrossEntropy = "online") -> dict[str, Fraction]:
    """§4.3's activations outside the transformer layers on one GPU, in bytes: on the ``first``
    stage the embedding dropout mask (1 byte, sbh/rep per micro-batch, ``in_flight`` of them; none
    without ``dropout``); on the ``last`` the final LayerNorm input and the output-layer input
    (``act``-byte activations, 2sbh/rep each at 2 bytes) and what the loss keeps
    (:func:`cross_entropy_terms`, ``v`` the rows the output layer has). ``rep``: what the
    replicated region is split by (t under SP, else 1)."""
    sbh, u = Fraction(s * b * h), Fraction(act, 2)
    out: dict[str, Fraction] = {}
    if first and dropout:
        out["embedding_dropout_mask"] = sbh * in_flight / rep
    if last:
        out["final_layernorm_input"] = 2 * sbh * u / rep
        out["output_layer_input"] = 2 * sbh * u / rep
        out.update(cross_entropy_terms(s=s, b=b, v=v, t=t, act=act, kind=cross_entropy))
    return out


def extra_bytes(*, s: int, b: int, h: int, v: int, t: int, p: int) -> dict[str, Number]:
    """Activations outside the transformer layers (§4.3), per GPU, in bytes, as the paper counts
    them (:func:`outside_layer_terms` with SP and dropout on, 16-bit activations).

    The embedding dropout mask (sbhp/t, on the first stage for p in-flight micro-batches) and,
    only on the stage holding the output layer, the final LayerNorm input (2sbh/t), the output
    layer input (2sbh/t) and the fp32 logits for the cross-entropy (4sbv/t; seqpar's own loss
    keeps less: :func:`cross_entropy_terms`).
    """
    _check_dims(s=s, b=b, h=h, v=v, t=t, p=p)
    terms = outside_layer_terms(s=s, b=b, h=h, v=v, t=t, rep=t, in_flight=p, cross_entropy="paper")
    return {name: _out(x) for name, x in terms.items()}


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
    g: int | None = None  # key/value heads (grouped-query attention); None = a
    f: int | None = None  # MLP width; None = 4h
    mlp: Mlp = "gelu"

    def __post_init__(self) -> None:
        dims = {k: getattr(self, k) for k in ("s", "b", "h", "a", "L", "v", "t", "p", "m")}
        bad = {k: x for k, x in dims.items() if not isinstance(x, int) or x < 1}
        if bad:
            raise ValueError(f"ModelShape {self.name!r}: dimensions must be positive ints, got {bad}")
        if self.h % self.a:
            raise ValueError(f"ModelShape {self.name!r}: hidden {self.h} not divisible by heads {self.a}")
        _sbh_terms(self.h, self.a, self.g, self.f, self.mlp)  # checks g, f, mlp
        if self.g == self.a:  # one spelling per shape, so equal shapes compare equal
            object.__setattr__(self, "g", None)
        if self.f == 4 * self.h and self.mlp == "gelu":
            object.__setattr__(self, "f", None)

    @property
    def layer_dims(self) -> dict:
        """Keyword arguments of :func:`bytes_per_layer` / :func:`activation_breakdown` for this shape."""
        return dict(s=self.s, b=self.b, h=self.h, a=self.a, t=self.t, kv_heads=self.g, ffn_hidden=self.f,
                    mlp=self.mlp)


def per_gpu_bytes(shape: ModelShape, technique: Technique) -> Number:
    """Peak activation bytes per GPU (Figure 1): Table 2's per-layer bytes x L x interleave factor.

    The §4.3 terms outside the layers are left out, as for the paper's Figure 1 and Figure 7.
    """
    _check(technique, s=shape.s, b=shape.b, h=shape.h, a=shape.a, t=shape.t)
    c = split_coefficient(h=shape.h, a=shape.a, kv_heads=_held(technique, shape.g, shape.t), ffn_hidden=shape.f,
                          mlp=shape.mlp)
    per_layer = _per_layer(technique, shape.s, shape.b, shape.h, shape.a, shape.t, c)
    return _out(per_layer * shape.L * _interleave(shape.p, shape.m))


def gib(n_bytes: Number) -> float:
    """Bytes to GiB (2**30 bytes)."""
    return float(Fraction(n_bytes) / GIB)


# keys a config must set itself for the formulas (a default vocabulary or batch would mislead)
SHAPE_KEYS = {"model": ("seq_len", "hidden", "heads", "layers", "vocab_size"), "train": ("micro_batch",)}


def load_sections(path: str | Path, overrides: Sequence[str] = ()) -> tuple[Path, dict]:
    """The resolved path and the ``model`` / ``parallel`` / ``train`` sections of a run config, with
    ``key=value`` ``overrides`` as ``seqpar train`` takes them (``model.seq_len=131072``).

    ``path`` is a YAML file or a shipped config's name (``paper/175b``). Each section is checked by
    the strict loader (unknown keys and wrong types name the dotted key); other sections are ignored,
    but every override is checked against the whole run schema, as ``seqpar train`` would.
    """
    path = resolve_config(path)
    if overrides:
        config.load_run_config(path, overrides)  # an override of any section: a real key, a valid value
    schema = {"model": GPTConfig, "parallel": ParallelConfig, "train": TrainConfig}
    return path, config.load_sections(path, schema, SHAPE_KEYS, overrides)


def shape_of(name: str, sections: dict) -> ModelShape:
    """The ``ModelShape`` of the sections returned by :func:`load_sections`."""
    model, par, train = sections["model"], sections["parallel"], sections["train"]
    return ModelShape(name=name, s=model.seq_len, b=train.micro_batch, h=model.hidden, a=model.heads,
                      L=model.layers, v=model.vocab_size, t=par.tp, p=par.pp, m=par.virtual_stages,
                      g=model.kv_heads, f=model.ffn_hidden, mlp=model.mlp)


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
