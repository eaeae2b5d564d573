"""Whether a checkpoint belongs to this run: the same model and the same data.

Model. Every ``model.*`` key of the checkpoint's ``config.yaml`` is compared with the new run's.
Keys that decide the parameters or what they compute (``MODEL_KEYS``) must be equal; keys that
only change how the same model runs (``RUNTIME_KEYS``) may change. ``seq_len`` may change only with
rotary positions (a learned position table has ``seq_len`` rows). Sections other than ``model``
(the parallel layout, the optimizer and schedule, the checkpoint settings) may change freely; the
data is compared as below. A refusal lists every changed key with its saved and new value.

Data. Checkpoints record a :func:`data_identity`: the number of tokens, a CRC-32 of up to 64
evenly spread 4096-token blocks of the token stream, a SHA-256 of the tokenizer's model
(vocabulary, merges, normalizer, pre-tokenizer, added tokens) and, for a blend, each source with
its normalised weight (the joined stream is the same whatever the weights draw from it). A
different token stream, tokenizer (including a tokenizer where there was none) or blend weights
are refused unless
``checkpoint.allow_data_change: true`` says the change is intended (fine-tuning on new data).
The source's path is not compared: the same tokens moved to another path are the same data.
Checkpoints written without an identity (``seqpar import``, older versions) are compared by their
``tokenizer.json`` alone, when both sides have a tokenizer.
"""
from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..config import ConfigError, RunConfig, load_sections, to_dict
from ..model.config import GPTConfig
from .errors import CheckpointCorrupt, CheckpointMismatch

# decide the parameters' shapes or what they compute: must be equal on resume
MODEL_KEYS = ("vocab_size", "hidden", "heads", "kv_heads", "layers", "ffn_hidden", "activation", "tie_embeddings",
              "layernorm_eps", "bias", "norm", "position", "rope_theta", "rope_scaling", "mlp", "qk_norm",
              "moe")  # the whole moe section, its loss coefficients included (a conservative choice)
# how the same model runs (regularisation, memory, kernels, layout, storage precision): may change.
# init_std only draws the weights a checkpoint overwrites; vocab_multiple pads rows checkpoints do not
# store; dtype converts the saved values on load.
RUNTIME_KEYS = ("dropout", "attention_dropout", "init_std", "vocab_multiple", "sequence_parallel", "recompute",
                "recompute_method", "recompute_num_layers", "recompute_layers", "recompute_ops", "attention", "dtype")
_BLOCK, _BLOCKS = 4096, 64


def _tokenizer_digest(text: str) -> str:
    """SHA-256 of the parts of a tokenizer's JSON that decide which ids a text gets."""
    data = json.loads(text)
    key = {k: data.get(k) for k in ("model", "normalizer", "pre_tokenizer", "added_tokens")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def data_identity(tokens: np.ndarray, tokenizer: Any = None,
                  blend: Sequence[tuple[str, float]] | None = None) -> dict:
    """What a checkpoint records of its training data: token count, a sampled CRC-32 of the
    token stream (``_BLOCKS`` blocks of ``_BLOCK`` ids, read from the memmap; cheap for any size),
    the tokenizer's digest (``tokenizer``: a ``tokenizers.Tokenizer`` or ``None``) and the blend
    (``(source, weight)`` pairs, weights normalised here; ``None`` for one source)."""
    n = int(len(tokens))
    crc = zlib.crc32(str(np.dtype(tokens.dtype)).encode())
    last = max(n - _BLOCK, 0)
    for i in sorted({(last * k) // (_BLOCKS - 1) for k in range(_BLOCKS)}):
        crc = zlib.crc32(np.ascontiguousarray(tokens[i:i + _BLOCK]).astype(np.int64).tobytes(), crc)
    total = sum(w for _, w in blend) if blend else 0.0
    return {"tokens": n, "sample_crc32": f"{crc:08x}",
            "tokenizer": None if tokenizer is None else _tokenizer_digest(tokenizer.to_str()),
            "blend": [{"source": str(s), "weight": round(w / total, 6)} for s, w in blend] if blend else None}


def _blend_text(blend: list[dict] | None) -> str:
    return "one source" if not blend else ", ".join(f"{b['source']} {b['weight']:g}" for b in blend)


def _saved_model(folder: Path) -> GPTConfig:
    path = folder / "config.yaml"
    try:
        return load_sections(path, {"model": GPTConfig})["model"]
    except (OSError, UnicodeDecodeError, ConfigError) as e:
        raise CheckpointCorrupt(f"{path} is unreadable ({str(e).splitlines()[0][:200]})") from None


def model_changes(saved: GPTConfig, new: GPTConfig) -> list[str]:
    """``key: saved -> new`` for each model key that may not change between save and resume."""
    old, now = to_dict(saved), to_dict(new)
    keys = [*MODEL_KEYS, *([] if new.position == "rope" and saved.position == "rope" else ["seq_len"])]
    keys += [k for k in now if k not in MODEL_KEYS and k not in RUNTIME_KEYS and k != "seq_len"]  # unclassified
    return [f"model.{k}: {old.get(k)!r} -> {now.get(k)!r}" for k in keys if old.get(k) != now.get(k)]


def data_changes(saved: dict | None, new: dict | None, saved_tokenizer: str | None) -> list[str]:
    """What differs between the saved and the new :func:`data_identity` (``saved`` ``None``: only
    the tokenizer, from the checkpoint's ``tokenizer.json`` text ``saved_tokenizer``)."""
    if new is None:
        return []
    if saved is None:
        if saved_tokenizer is None or new.get("tokenizer") is None:
            return []
        saved = {"tokenizer": _tokenizer_digest(saved_tokenizer)}
        new = {"tokenizer": new["tokenizer"]}
    out = []
    if (saved.get("tokens"), saved.get("sample_crc32")) != (new.get("tokens"), new.get("sample_crc32")):
        out.append(f"the token stream ({saved.get('tokens')} tokens, sample crc32 {saved.get('sample_crc32')} -> "
                   f"{new.get('tokens')} tokens, {new.get('sample_crc32')})")
    weights = lambda d: [b["weight"] for b in d.get("blend") or []]  # noqa: E731
    if "blend" in saved and weights(saved) != weights(new):  # the source paths may move, as for one source
        out.append(f"the blend weights ({_blend_text(saved['blend'])} -> {_blend_text(new.get('blend'))})")
    if saved.get("tokenizer") != new.get("tokenizer"):
        what = lambda d: "none" if d is None else d[:12]  # noqa: E731
        out.append(f"a different tokenizer ({what(saved.get('tokenizer'))} -> {what(new.get('tokenizer'))}), "
                   f"so ids would mean other tokens")
    return out


def check_compatible(folder: str | Path, config: RunConfig, data: dict | None, extra: dict) -> None:
    """Raise :class:`CheckpointMismatch` (one line) when checkpoint ``folder`` holds another model
    than ``config.model`` or (unless ``checkpoint.allow_data_change``) was trained on other data
    than ``data`` (this run's :func:`data_identity`). ``extra``: the checkpoint's ``extra.json``."""
    folder = Path(folder)
    changed = model_changes(_saved_model(folder), config.model)
    if changed:
        raise CheckpointMismatch(f"checkpoint {folder} holds another model than this run: {'; '.join(changed)}. "
                                 f"Resume with the saved values, or start over in a new checkpoint.dir")
    if config.checkpoint.allow_data_change:
        return
    tok = folder / "tokenizer.json"
    try:
        saved_tok = tok.read_text() if "data_identity" not in extra and tok.is_file() else None
        changed = data_changes(extra.get("data_identity"), data, saved_tok)
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"{tok} is unreadable ({type(e).__name__})") from None
    if changed:
        given = "data.sources" if config.data.sources else f"data.source={config.data.source!r}"
        raise CheckpointMismatch(f"checkpoint {folder} was trained on other data than {given} gives: "
                                 f"{'; '.join(changed)}. Use the original data, or set "
                                 f"checkpoint.allow_data_change=true if the change is intended")


__all__ = ["MODEL_KEYS", "RUNTIME_KEYS", "check_compatible", "data_changes", "data_identity", "model_changes"]
