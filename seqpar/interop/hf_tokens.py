"""Special tokens of a Hugging Face export: bos / eos / pad ids and the tokenizer files around them.

A checkpoint carries its tokenizer (``tokenizer.json``) and, when the tokenizer was given or
imported, ``tokenizer_origin.json`` with its end-of-text id (``eot_id``; an import also records
the model's ``bos_id`` and ``pad_id``). The export writes these ids into ``config.json`` and
``generation_config.json`` and the tokens' names into ``tokenizer_config.json``, so
``AutoTokenizer`` has an eos token and ``generate`` stops at end of text. Without a tokenizer the
ids are left unset (never GPT-2's 50256 outside a smaller vocabulary).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..data.tokenizer import ORIGIN_FILE, find_eot

KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _tokenizer(path: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _first_id(value) -> int | None:
    """An id of a Hugging Face config field (an int, a list of ints (Llama 3), or None)."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _known(tok, value) -> int | None:
    """``value`` if the tokenizer has a token of that id, else None."""
    value = _first_id(value)
    return value if value is not None and tok.id_to_token(value) is not None else None


def _named_ids(tok, hf_dir: Path) -> dict[str, int]:
    """``{"bos" | "eos" | "pad": id}`` of the tokens ``hf_dir/tokenizer_config.json`` names (as a
    string or ``{"content": ...}``) that the tokenizer has."""
    try:
        config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for kind in ("bos", "eos", "pad"):
        name = config.get(f"{kind}_token") if isinstance(config, dict) else None
        name = name.get("content") if isinstance(name, dict) else name
        found = tok.token_to_id(name) if isinstance(name, str) else None
        if found is not None:
            out[kind] = found
    return out


def imported_origin(tok_file: Path | None, hf_config, hf_dir: Path) -> dict:
    """``tokenizer_origin.json``'s content for an import: the bos / eos / pad tokens
    ``tokenizer_config.json`` names, else the model config's ids where the tokenizer has them, else
    its end-of-text token (the usual names) for eos and bos."""
    if tok_file is None:
        return {}
    tok = _tokenizer(tok_file)
    named = _named_ids(tok, hf_dir)  # tokenizer_config.json's tokens first: they are the tokenizer's own
    eos = named.get("eos", _known(tok, getattr(hf_config, "eos_token_id", None)))
    if eos is None:
        try:
            eos = find_eot(tok, hf_dir)
        except ValueError:  # TokenizerError: none of the usual end-of-text names
            eos = None
    bos = named.get("bos", _known(tok, getattr(hf_config, "bos_token_id", None)))
    pad = named.get("pad", _known(tok, getattr(hf_config, "pad_token_id", None)))
    return {"origin": "given", "eot_id": eos, "bos_id": bos if bos is not None else eos, "pad_id": pad}


def special_ids(checkpoint: Path) -> dict[str, int | None]:
    """``{"bos_token_id", "eos_token_id", "pad_token_id"}`` of ``checkpoint``'s tokenizer: the recorded
    ids (``tokenizer_origin.json``), else its end-of-text token for bos and eos; None without one."""
    ids = dict.fromkeys(KEYS)
    if not (checkpoint / "tokenizer.json").is_file():
        return ids
    tok = _tokenizer(checkpoint / "tokenizer.json")
    origin = {}
    if (checkpoint / ORIGIN_FILE).is_file():
        try:
            origin = json.loads((checkpoint / ORIGIN_FILE).read_text())
        except (OSError, ValueError):
            origin = {}
    origin = origin if isinstance(origin, dict) else {}
    eos = _known(tok, origin.get("eot_id"))
    if eos is None:
        try:
            eos = find_eot(tok)
        except ValueError:
            eos = None
    bos = _known(tok, origin.get("bos_id"))
    ids.update(bos_token_id=bos if bos is not None else eos, eos_token_id=eos,
               pad_token_id=_known(tok, origin.get("pad_id")))
    return ids


def write_tokenizer_files(checkpoint: Path, out: Path, ids: dict[str, int | None], seq_len: int) -> set[str]:
    """``tokenizer_config.json`` (the special tokens by name) and ``generation_config.json`` (their ids)
    in ``out``; the names written (none without a tokenizer)."""
    from transformers import GenerationConfig

    if not (checkpoint / "tokenizer.json").is_file():
        return set()
    tok = _tokenizer(checkpoint / "tokenizer.json")
    names = {key.replace("_id", ""): tok.id_to_token(i) for key, i in ids.items() if i is not None}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
              "clean_up_tokenization_spaces": False, **names}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    pad = ids["pad_token_id"] if ids["pad_token_id"] is not None else ids["eos_token_id"]
    GenerationConfig(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"],
                     pad_token_id=pad).save_pretrained(out)
    return {"tokenizer_config.json", "generation_config.json"}


__all__ = ["KEYS", "imported_origin", "special_ids", "write_tokenizer_files"]
