"""What ``seqpar verify TARGET`` checks, and the small copy of it that it runs.

TARGET is one of

* a shipped config name or a YAML file (seqpar's own ``GPT``): the model section, shrunk;
* a Hugging Face model folder (its ``config.json``) or such a ``config.json``: a ``LlamaForCausalLM``
  or ``GPT2LMHeadModel`` built from the shrunk config with random weights, converted by the
  drop-in plans ``seqpar.plans.llama()`` / ``gpt2()``;
* ``module:function``: your own code; ``function()`` returns ``(model, plan)`` or a
  :class:`UserModel` (model, plan and how to compute its loss). The plan is a
  :class:`~seqpar.dropin.Plan` for ``seqpar.parallelize``, or your own ``convert(model, mesh) ->
  model`` for a model converted by hand (it then chooses SP itself). It is called once per layout
  on every rank, and must return the same weights each time (seed it, or let ``verify`` seed torch
  before each call). It is not shrunk: build it small.

Shrinking keeps the structure and makes the model cheap: 2 layers (``2 x pp`` when more are
needed), 4 query heads with the same query / key-value head ratio, head size 16, the MLP width in
the same ratio to the hidden size, a 16-token sequence and a vocabulary of 125 (128 when the
original divides by 8: an odd original stays one that needs padding), tied embeddings as they were.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...config import RunConfig, load_run_config
from ...errors import UserError

SEQ_LEN, HEADS, HEAD_DIM, LAYERS = 16, 4, 16, 2
FUNCTION = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
HF_TYPES = ("llama", "gpt2")


@dataclass
class UserModel:
    """What a ``module:function`` target returns: the model, its drop-in plan, and optionally
    ``loss(model, tokens) -> scalar`` (default: ``model(input_ids=tokens, labels=tokens).loss``,
    or the output itself when it is a tensor), the vocabulary for random tokens (default: the
    model's ``config.vocab_size`` or its first embedding's rows) and the sequence length."""

    model: Any
    plan: Any
    loss: Callable | None = None
    vocab_size: int | None = None
    seq_len: int = SEQ_LEN


@dataclass(frozen=True)
class Target:
    """A resolved TARGET (module docstring); picklable, so ranks rebuild the model from it."""

    kind: str                              # "seqpar" | "hf" | "function"
    name: str                              # as the user wrote it
    run: RunConfig | None = None           # seqpar: the shrunk run config
    hf_type: str | None = None             # hf: "llama" | "gpt2"
    hf_config: dict = field(default_factory=dict)  # hf: the shrunk config's keys
    function: Any = None                   # function: "module:function", or a module-level callable
    plan: Any = None                       # function: the plan, when the callable returns only the model


def _round(x: float, multiple: int) -> int:
    return max(multiple, int(round(x / multiple)) * multiple)


def _small_vocab(vocab: int) -> int:
    return 128 if vocab % 8 == 0 else 125


def _kv(heads: int, kv: int | None) -> int:
    """Key/value heads keeping ``heads / kv`` at :data:`HEADS` query heads (at least one)."""
    if not kv or kv == heads:
        return HEADS
    return max(1, HEADS * kv // heads)


def shrink_run(cfg: RunConfig, layers: int = LAYERS) -> RunConfig:
    """``cfg`` with its model shrunk (module docstring); norms, positions, MLP kind, bias, ties,
    attention kernel kept."""
    m = cfg.model
    hidden = HEADS * HEAD_DIM
    ratio = (m.ffn_hidden or 4 * m.hidden) / m.hidden
    model = dataclasses.replace(m, vocab_size=_small_vocab(m.vocab_size), seq_len=SEQ_LEN, hidden=hidden,
                                heads=HEADS, kv_heads=None if m.kv_heads is None else _kv(m.heads, m.kv_heads),
                                layers=layers, ffn_hidden=_round(ratio * hidden, 8), recompute="none",
                                recompute_layers=None, vocab_multiple=1, rope_scaling=None)
    return dataclasses.replace(cfg, model=model)


def shrink_hf(model_type: str, config: dict) -> dict:
    """The keys of a Hugging Face ``config.json`` that :func:`shrink_run`'s rules change."""
    out = {k: v for k, v in config.items() if not k.startswith("_") and k not in ("architectures", "auto_map")}
    hidden = HEADS * HEAD_DIM
    if model_type == "gpt2":
        ratio = (config.get("n_inner") or 4 * config["n_embd"]) / config["n_embd"]
        out.update(n_layer=LAYERS, n_head=HEADS, n_embd=hidden, n_inner=_round(ratio * hidden, 8), n_positions=64,
                   vocab_size=_small_vocab(config.get("vocab_size", 50257)))
    else:
        heads = config.get("num_attention_heads", HEADS)
        ratio = config.get("intermediate_size", 4 * config.get("hidden_size", hidden)) / config.get("hidden_size", hidden)
        out.update(num_hidden_layers=LAYERS, num_attention_heads=HEADS, hidden_size=hidden, head_dim=HEAD_DIM,
                   num_key_value_heads=_kv(heads, config.get("num_key_value_heads")),
                   intermediate_size=_round(ratio * hidden, 8), max_position_embeddings=64,
                   vocab_size=_small_vocab(config.get("vocab_size", 32000)), rope_scaling=None)
    return out


def _hf_target(name: str, path: Path, shrink: bool) -> Target:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise UserError(f"verify: {name!r} is a folder without a config.json; give a Hugging Face model folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"verify: cannot read {str(config_file)!r} as JSON: {e}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type not in HF_TYPES:
        raise UserError(f"verify: {str(config_file)!r} has model_type={model_type!r}; the drop-in plans cover "
                        f"{', '.join(HF_TYPES)} (for another model pass module:function returning your model and plan)")
    return Target("hf", name, hf_type=model_type, hf_config=shrink_hf(model_type, config) if shrink else config)


def resolve_target(name: str, *, shrink: bool = True, pp: int = 1) -> Target:
    """TARGET (module docstring) -> :class:`Target`. ``pp``: the most pipeline stages a layout
    asks for, so the shrunk model keeps enough layers. :class:`UserError` naming TARGET when it is
    none of the three."""
    path = Path(name)
    if FUNCTION.match(name) and not path.exists():
        module, _, fn = name.partition(":")
        try:
            getattr(importlib.import_module(module), fn)
        except (ImportError, AttributeError) as e:
            raise UserError(f"verify: cannot load {name!r}: {e}") from None
        return Target("function", name, function=name)
    if path.is_dir() or path.suffix == ".json":
        return _hf_target(name, path, shrink)
    cfg = load_run_config(name)  # a YAML file or a shipped name; MissingFile (a UserError) lists them
    layers = max(LAYERS, 2 * pp) if shrink else cfg.model.layers
    return Target("seqpar", name, run=shrink_run(cfg, layers) if shrink else cfg)


def load_function(spec: Any) -> Callable[[], Any]:
    """``"module:function"`` -> the function (a callable is returned as it is)."""
    if callable(spec):
        return spec
    module, _, fn = spec.partition(":")
    return getattr(importlib.import_module(module), fn)


def as_user_model(out: Any, spec: Any, plan: Any = None) -> UserModel:
    """What a ``module:function`` returned, as a :class:`UserModel`: one already, a ``(model, plan)``
    pair, or the model alone when ``plan`` is given."""
    if isinstance(out, UserModel):
        return out
    if isinstance(out, tuple) and len(out) == 2:
        return UserModel(*out)
    if plan is not None and callable(getattr(out, "named_parameters", None)):
        return UserModel(out, plan)
    name = getattr(spec, "__qualname__", spec)
    raise UserError(f"verify: {name}() must return (model, plan) or a seqpar.verify.UserModel, got {type(out).__name__}")


__all__ = ["Target", "UserModel", "as_user_model", "load_function", "resolve_target", "shrink_hf", "shrink_run"]
