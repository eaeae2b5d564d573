"""Property-based tests: the config loader over every typed field of the run schema, and the
operators' shape checks (single process, ``tp_group=None`` plus the shape-validation helpers)."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import tempfile
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from seqpar.config import ConfigError, RunConfig, dump, dump_yaml, load_run_config, to_dict
from seqpar.config.yaml12 import Dumper, plain_scalar
from seqpar.config.loader import config_key
from seqpar.distributed import regions
from seqpar.distributed.collectives import check_divisible
from seqpar.layers import ColumnParallelLinear, RowParallelLinear
from seqpar.model.config import GPTConfig

FAST = settings(max_examples=50, deadline=None)


# --------------------------------------------------------------------------- the schema, field by field

def _schema(cls: type = RunConfig, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> annotation for every leaf field of the run schema."""
    hints, out = get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], config_key(f)  # the YAML key (checkpoint.async is the field async_save)
        if dataclasses.is_dataclass(tp):
            out.update(_schema(tp, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = tp
    return out


SCHEMA = _schema()


def _floats(lo: float, hi: float, **kw) -> st.SearchStrategy[float]:
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, **kw)


def _mult(k: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(1, hi).map(lambda n: k * n)


# Strings with the characters YAML cares about: quotes, '#', ': ', brackets, anchors, tags, and
# words that YAML 1.1 reads as booleans or numbers.
TEXT = st.one_of(
    st.text(st.characters(exclude_categories=("Cs",)), max_size=12),
    st.sampled_from(["yes", "no", "on", "off", "010", "0o17", "1:30", "1e5", ".nan", "null", "~", "true",
                     "run #1", "a: b", "- x", "*ref", "&a b", "!!int 3", "'q'", " lead", "trail ", "2024-01-01"]),
)
NONE_OR_TEXT = st.none() | TEXT
UNIT = _floats(0.0, 1.0, exclude_max=True)

# Valid values, chosen so that any combination of them is a valid config together (the two rules
# they cannot keep are applied in `valid_values`): hidden is a multiple of 48 and heads one of 4, 8,
# 12, 24 (an even head dim); every TP-split size is a multiple of 4 and tp is 1, 2 or 4; min_lr <=
# 1e-3 <= lr; recompute_num_layers <= 4 <= layers. Keys the schema does not have are dropped, and
# fields of the schema missing here keep their defaults (test_every_schema_field_... names them).
ROPE_SCALING = st.fixed_dictionaries({}, optional={
    "factor": _floats(0.5, 64.0), "low_freq_factor": _floats(0.5, 1.0), "high_freq_factor": _floats(2.0, 8.0),
    "original_max_position_embeddings": st.integers(1, 2**17)})
VALID: dict[str, st.SearchStrategy] = {
    "model.vocab_size": st.integers(1, 100_000), "model.seq_len": _mult(4, 4096), "model.hidden": _mult(48, 200),
    "model.heads": st.sampled_from([4, 8, 12, 24]), "model.layers": st.integers(4, 128),
    "model.ffn_hidden": st.none() | _mult(4, 20_000), "model.dropout": UNIT, "model.attention_dropout": UNIT,
    "model.layernorm_eps": _floats(0.0, 1.0, exclude_min=True), "model.init_std": _floats(0.0, 10.0),
    "model.recompute_num_layers": st.integers(1, 4), "model.kv_heads": st.sampled_from([None, 4]),
    "model.vocab_multiple": st.integers(1, 256), "model.rope_theta": _floats(1.0, 1e7),
    "model.rope_scaling": st.none() | ROPE_SCALING,
    "model.recompute_layers": st.none() | st.lists(st.sampled_from(["none", "selective", "full"]), min_size=1,
                                                   max_size=4),  # resized to model.layers in valid_values
    "model.recompute_ops": st.lists(st.sampled_from(["norm", "activation", "dropout"]), unique=True, max_size=3),
    "parallel.tp": st.sampled_from([1, 2, 4]), "parallel.dp": st.none() | st.integers(1, 4096),
    "parallel.pp": st.just(1), "parallel.virtual_stages": st.just(1),  # m > 1 needs pp > 1 dividing L
    "parallel.cp": st.just(1),  # cp > 1 needs seq_len in 2*cp chunks and no attention dropout
    "parallel.ep": st.just(1),  # ep > 1 needs model.moe and dp divisible by it
    "model.moe": st.none() | st.fixed_dictionaries({"experts": st.just(8), "top_k": st.integers(1, 8)}, optional={
        "router": st.sampled_from(["softmax", "sigmoid"]), "aux_loss_coeff": _floats(0.0, 1.0),
        "capacity_factor": st.none() | _floats(0.5, 4.0), "every": st.integers(1, 4)}),
    "parallel.timeout_minutes": _floats(0.0, 1e6, exclude_min=True),
    "parallel.bucket_mib": _floats(0.0, 1e6, exclude_min=True),
    "parallel.data_parallel": st.sampled_from([None, "ddp", "fsdp"]),
    "parallel.pp_schedule": st.sampled_from([None, "1F1B", "Interleaved1F1B", "GPipe"]),
    "data.source": NONE_OR_TEXT, "data.max_bytes": st.integers(1, 2**50),
    "data.eval_fraction": _floats(0.0, 1.0, exclude_min=True, exclude_max=True), "data.cache_dir": NONE_OR_TEXT,
    "data.sources": st.lists(st.fixed_dictionaries({"source": st.sampled_from(["a/", "b.bin"]),
                                                    "weight": _floats(1e-3, 1e3)}), max_size=2),
    "data.tokenizer": NONE_OR_TEXT, "data.eot_id": st.none() | st.integers(0, 2**31), "data.workers": st.integers(1, 64),
    "data.document_masking": st.just(False),  # true is refused: not supported yet
    "train.steps": st.integers(1, 10**7), "train.micro_batch": st.integers(1, 1024),
    "train.global_batch": st.none() | st.integers(1, 10**6), "train.lr": _floats(1e-3, 10.0),
    "train.min_lr": _floats(0.0, 1e-3), "train.warmup_steps": st.integers(0, 10**6),
    "train.weight_decay": _floats(0.0, 10.0), "train.beta1": UNIT, "train.beta2": UNIT,
    "train.grad_clip": _floats(0.0, 1e3), "train.seed": st.integers(0, 2**64),
    "train.sample_prompt": st.none() | st.sampled_from(["def ", "The ", "Once upon a time,"]),
    "train.log_interval": st.integers(1, 10**4), "train.eval_interval": st.integers(0, 10**4),
    "train.eval_batches": st.integers(1, 1000), "train.threads_per_rank": st.integers(1, 256),
    "train.max_skipped_steps": st.integers(1, 10**6), "train.sample_tokens": st.integers(0, 10**4),
    "checkpoint.resume": st.sampled_from(["auto", "never", "runs/ckpt", "runs/ckpt/step_00000010"]),
    "train.memory_budget_gib": st.none() | _floats(0.0, 1e6, exclude_min=True),
    "train.compile": st.sampled_from([True, False, "auto"]),
    "checkpoint.dir": TEXT, "checkpoint.interval": st.integers(0, 10**6), "checkpoint.keep": st.integers(1, 1000),
    "out_dir": TEXT,
}


def _derived(tp: Any) -> st.SearchStrategy | None:
    """Valid values read off the annotation alone (Literal, bool, str); None for numbers."""
    if get_origin(tp) is Literal:
        return st.sampled_from(get_args(tp))
    return {bool: st.booleans(), str: TEXT}.get(tp)


VALID = {k: s for k, s in VALID.items() if k in SCHEMA}
VALID.update({k: s for k, tp in SCHEMA.items() if k not in VALID and (s := _derived(tp)) is not None})


@st.composite
def valid_values(draw) -> dict[str, Any]:
    """Some fields with valid values; the cross-field rules a field-by-field draw can break are kept."""
    values = draw(st.fixed_dictionaries({}, optional=VALID))
    if not values:  # a file that sets nothing is refused (tests/test_config_loader.py): give it a key
        values["train.seed"] = draw(VALID["train.seed"])
    if values.get("model.rope_scaling") is not None:
        values["model.position"] = "rope"  # scaling is for rotary positions only
    if values.get("model.mlp") == "swiglu" and "model.activation" in values:
        values["model.activation"] = "gelu"  # SwiGLU has its own activation
    if values.get("model.recompute") == "auto" and values.get("train.memory_budget_gib") is None:
        values["train.memory_budget_gib"] = 80.0  # auto chooses under a budget
    if values.get("data.sources"):
        values.pop("data.source", None)  # a blend or one source, not both
    if values.get("parallel.tp_overlap"):
        values["model.sequence_parallel"] = True  # the overlap is of SP's collectives
    if values.get("model.moe") is not None and values.get("train.compile") is True:
        values["train.compile"] = "auto"  # MoE blocks run eagerly
    if values.get("train.compile") is True:  # compiled blocks: no cp
        values["parallel.cp"] = 1
    modes = values.get("model.recompute_layers")
    if modes is not None:  # one mode per layer
        layers = values.get("model.layers", 12)
        values["model.recompute_layers"] = (modes * layers)[:layers]
    _keep_recompute_ops_meaningful(values)
    return values


def _keep_recompute_ops_meaningful(values: dict[str, Any]) -> None:
    """Drop recompute ops another drawn field makes meaningless (all full, MoE, compiled, no dropout)."""
    ops = values.get("model.recompute_ops")
    if not ops:
        return
    modes = values.get("model.recompute_layers") or [values.get("model.recompute", "selective")]
    if values.get("model.moe") is not None or all(m == "full" for m in modes) or values.get("train.compile") is True:
        values["model.recompute_ops"] = []
    elif values.get("model.dropout", 0.1) == 0:
        values["model.recompute_ops"] = [op for op in ops if op != "dropout"]

NEG = st.floats(max_value=0.0, exclude_max=True).filter(lambda v: v < 0)
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
BELOW = {1: st.integers(max_value=0), 0: st.integers(max_value=-1)}

# Out-of-range values of the right type; each must be refused naming its dotted key.
OUT_OF_RANGE: dict[str, st.SearchStrategy] = {
    **{f"model.{k}": BELOW[1] for k in ("vocab_size", "seq_len", "hidden", "heads", "layers", "ffn_hidden",
                                         "recompute_num_layers")},
    "model.dropout": NEG | st.floats(min_value=1.0) | NONFINITE,
    "model.attention_dropout": NEG | st.floats(min_value=1.0) | NONFINITE,
    "model.layernorm_eps": st.floats(max_value=0.0) | NONFINITE, "model.init_std": NEG | NONFINITE,
    "model.kv_heads": BELOW[1] | st.sampled_from([5, 7, 24]), "model.vocab_multiple": BELOW[1],  # heads = 12
    **{f"parallel.{k}": BELOW[1] for k in ("tp", "dp", "virtual_stages", "cp", "ep")},
    "parallel.pp": BELOW[1] | st.sampled_from([5, 7, 11]),  # the default 12 layers split into no such stages
    "parallel.timeout_minutes": st.floats(max_value=0.0) | NONFINITE,
    "parallel.bucket_mib": st.floats(max_value=0.0) | NONFINITE,
    "data.max_bytes": BELOW[1], "data.eval_fraction": st.floats(max_value=0.0) | st.floats(min_value=1.0) | NONFINITE,
    "data.workers": BELOW[1], "data.eot_id": BELOW[0], "data.document_masking": st.just(True),
    "data.sources": st.lists(st.fixed_dictionaries({"source": st.just("a/"), "weight": st.floats(max_value=0.0)
                                                    | NONFINITE}), min_size=1, max_size=2),
    **{f"train.{k}": BELOW[1] for k in ("steps", "micro_batch", "global_batch", "log_interval", "eval_batches",
                                         "threads_per_rank")},
    "train.warmup_steps": BELOW[0], "train.eval_interval": BELOW[0], "train.seed": BELOW[0],
    "train.lr": st.floats(max_value=1e-4, exclude_max=True) | NONFINITE,  # <= 0, or below min_lr=1e-4
    "train.min_lr": NEG | st.floats(min_value=1e-3, exclude_min=True) | NONFINITE,  # < 0, or above lr=1e-3
    "train.beta1": NEG | st.floats(min_value=1.0) | NONFINITE, "train.beta2": NEG | st.floats(min_value=1.0) | NONFINITE,
    "train.weight_decay": NEG | NONFINITE, "train.grad_clip": NEG | NONFINITE,
    "train.memory_budget_gib": st.floats(max_value=0.0) | NONFINITE,
    "train.compile": st.sampled_from(["yes", "on", 1]),
    "model.recompute_layers": st.lists(st.sampled_from(["none", "selective", "full"]), max_size=11),  # layers = 12
    "model.recompute_ops": st.lists(st.sampled_from(["norms", "gelu", "attention", "full"]), min_size=1, max_size=2),
    "checkpoint.interval": BELOW[0], "checkpoint.keep": BELOW[1], "train.max_skipped_steps": BELOW[1],
}
OUT_OF_RANGE = {k: s for k, s in OUT_OF_RANGE.items() if k in SCHEMA}


def _accepts(tp: Any, v: Any) -> bool:
    """Whether annotation ``tp`` takes a value of ``v``'s type (ints for floats; bools are not ints)."""
    if get_origin(tp) in (Union, types.UnionType):
        return any(_accepts(a, v) for a in get_args(tp))
    if get_origin(tp) is Literal:
        return any(v == a and type(v) is type(a) for a in get_args(tp))
    if dataclasses.is_dataclass(tp):
        return isinstance(v, dict)
    number = isinstance(v, (int, float)) and not isinstance(v, bool)
    checks = {type(None): v is None, bool: isinstance(v, bool), int: number and isinstance(v, int),
              float: number, str: isinstance(v, str)}
    return checks.get(tp, True)


ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), TEXT,
                      st.lists(st.integers(), max_size=3))


def _invalid(key: str) -> st.SearchStrategy:
    wrong_type = ANY_VALUE.filter(lambda v: not _accepts(SCHEMA[key], v))
    return wrong_type | OUT_OF_RANGE[key] if key in OUT_OF_RANGE else wrong_type


# --------------------------------------------------------------------------- writing values two ways

def _override_text(value: Any) -> str:
    """How a user writes ``value`` after ``key=``: YAML 1.2 plain scalars, strings double-quoted
    (YAML escapes) only where needed, lists in flow style."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, float):
        return ".nan" if math.isnan(value) else {math.inf: ".inf", -math.inf: "-.inf"}.get(value, repr(value))
    if isinstance(value, str):
        plain = value and value == value.strip() and value[0] not in "'\"[{" and isinstance(plain_scalar(value), str)
        return value if plain else yaml.dump(value, Dumper=Dumper, default_style='"', width=math.inf).strip()
    return json.dumps(value)


def _nested(values: dict[str, Any]) -> dict:
    out: dict = {}
    for key, value in values.items():
        *sections, name = key.split(".")
        node = out
        for s in sections:
            node = node.setdefault(s, {})
        node[name] = value
    return out


def _from_file(values: dict[str, Any]) -> RunConfig:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(dump_yaml(_nested(values)), encoding="utf-8")
        return load_run_config(path)


def _from_overrides(values: dict[str, Any]) -> RunConfig:
    return load_run_config(None, [f"{k}={_override_text(v)}" for k, v in values.items()])


def _get(cfg: RunConfig, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, {config_key(f): f.name for f in dataclasses.fields(cfg)}[part])
    return cfg


# --------------------------------------------------------------------------- config loader properties

@FAST
@given(valid_values())
def test_valid_values_load_the_same_from_yaml_and_overrides_and_round_trip(values):
    from_file, from_cli = _from_file(values), _from_overrides(values)
    assert from_file == from_cli
    for key, value in values.items():
        got = to_dict(_get(from_cli, key))
        if isinstance(value, dict):  # a nested section given in part: the rest keeps its defaults
            got = {k: got[k] for k in value}
        if not (key == "model.ffn_hidden" and value is None):  # None: the MLP's default width
            assert got == value, key
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "dumped.yaml"
        path.write_text(dump(from_cli), encoding="utf-8")
        assert load_run_config(path) == from_cli


@FAST
@given(st.sampled_from(sorted(SCHEMA)).flatmap(lambda key: st.tuples(st.just(key), _invalid(key))))
def test_invalid_values_raise_config_error_naming_the_dotted_key(key_value):
    key, value = key_value
    for load in (_from_file, _from_overrides):
        with pytest.raises(ConfigError) as err:
            load({key: value})
        assert key in str(err.value) and len(str(err.value)) < 600, (load.__name__, str(err.value))


def test_every_schema_field_has_valid_and_invalid_values():
    """New fields need a line here (numbers: in VALID and OUT_OF_RANGE) unless read off their type."""
    numeric = [k for k, tp in SCHEMA.items() if _derived(tp) is None]
    assert set(numeric) <= set(VALID), sorted(set(numeric) - set(VALID))
    assert set(OUT_OF_RANGE) <= set(SCHEMA), sorted(set(OUT_OF_RANGE) - set(SCHEMA))


# --------------------------------------------------------------------------- shape checks

def _names(msg: str, number: int, shape: tuple[int, ...] = ()) -> bool:
    """``number`` appears in ``msg`` as a number of its own, outside the printed ``shape``."""
    return re.search(rf"(?<![\d.]){number}(?![\d.])", msg.replace(str(tuple(shape)), "")) is not None


@FAST
@given(st.integers(0, 10**6), st.integers(1, 64))
def test_check_divisible_raises_exactly_when_not_divisible(size, t):
    if size % t:
        with pytest.raises(ValueError, match=f"t={t}") as err:
            check_divisible(size, t, "dim")
        assert _names(str(err.value), size), str(err.value)
    else:
        check_divisible(size, t, "dim")


SHAPES = st.lists(st.integers(1, 9), min_size=1, max_size=4)


@FAST
@given(SHAPES, st.integers(-5, 4), st.integers(1, 6))
def test_operator_dim_check_names_the_size_or_the_dim(shape, dim, t):
    x = torch.empty(shape)
    if not -len(shape) <= dim < len(shape):
        with pytest.raises(ValueError, match="out of range") as err:
            regions._check_dim(x, dim, t, "op")
        assert _names(str(err.value), dim, shape) and str(tuple(shape)) in str(err.value), str(err.value)
    elif shape[dim] % t:
        with pytest.raises(ValueError, match=f"t={t}") as err:
            regions._check_dim(x, dim, t, "op")
        assert _names(str(err.value), shape[dim], shape), str(err.value)
    else:
        regions._check_dim(x, dim, t, "op")


@FAST
@given(SHAPES, st.data())
def test_one_rank_operators_are_the_identity_for_any_shape(shape, data):
    x = torch.randn(shape)
    seq_dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    for op in (regions.gather_from_sp, regions.reduce_scatter_to_sp, regions.scatter_to_sp,
               regions.gather_to_replicated):
        assert op(x, None, seq_dim) is x, op.__name__
    for op in (regions.copy_to_tp, regions.reduce_from_tp, regions.gather_from_tp, regions.split_to_tp):
        assert op(x, None) is x, op.__name__


@FAST
@given(st.integers(1, 8), st.integers(1, 48), st.integers(1, 5))
def test_column_layer_chunks_must_divide_out_features(in_features, out_features, chunks):
    make = lambda: ColumnParallelLinear(in_features, out_features, chunks=chunks, tp_group=None)  # noqa: E731
    if out_features % chunks:
        with pytest.raises(ValueError, match=rf"out_features.*\b{out_features}\b"):
            make()
    else:
        assert make().weight.shape == (out_features, in_features)


@FAST
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.lists(st.integers(1, 3), max_size=2),
       st.booleans())
def test_linear_layers_refuse_a_wrong_input_width_naming_it(in_features, width, out_features, lead, row):
    cls = RowParallelLinear if row else ColumnParallelLinear
    layer = cls(in_features, out_features, tp_group=None)
    x = torch.randn(*lead, width)
    if width != in_features:
        with pytest.raises(ValueError) as err:
            layer(x)
        msg = str(err.value)
        assert _names(msg, width, tuple(x.shape)) and _names(msg, in_features, tuple(x.shape)), msg
    else:
        assert layer(x).shape == (*lead, out_features)


@FAST
@given(st.sampled_from([1, 2, 3, 4, 6, 8]), st.integers(1, 6), st.integers(1, 64), st.integers(1, 256),
       st.integers(1, 8), st.booleans())
def test_gpt_check_parallel_names_every_size_t_does_not_divide(heads, head_dim, ffn, seq, t, sp):
    cfg = GPTConfig(vocab_size=840, seq_len=seq, hidden=heads * head_dim, heads=heads, layers=1,
                    ffn_hidden=ffn, sequence_parallel=sp)  # 840: every t in 1..8 divides the vocabulary
    sizes = {"heads": heads, "hidden": heads * head_dim, "ffn_hidden": ffn}
    if sp:
        sizes["seq_len"] = seq
    bad = {name: size for name, size in sizes.items() if size % t}
    if not bad:
        cfg.check_parallel(t)
        return
    with pytest.raises(ValueError) as err:
        cfg.check_parallel(t)
    for name, size in bad.items():
        assert f"{name} ({size}" in str(err.value), (name, str(err.value))
    assert f"t={t}" in str(err.value)
