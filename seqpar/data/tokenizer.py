"""Tokenizers the user brings: a ``tokenizer.json`` or a local Hugging Face model folder.

``data.tokenizer`` names one; text sources are then encoded with it (no BPE training). A
folder is read with ``tokenizers`` when it holds ``tokenizer.json``, else with ``transformers``
(slow files such as ``tokenizer.model``, converted to the fast form). Without ``data.tokenizer``,
resuming a checkpoint that carries a tokenizer it did not train itself (``seqpar import``, or a
run that had ``data.tokenizer``) uses that tokenizer, so the ids keep their meaning.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

from .errors import TokenizerError

EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
ORIGIN_FILE = "tokenizer_origin.json"  # beside a checkpoint's tokenizer.json: "given" or "trained"


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """The tokenizer of ``spec``: a ``tokenizer.json`` file or a local model folder (never downloaded)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return _from_file(path)
    if not path.is_dir():
        raise TokenizerError(f"data.tokenizer={str(spec)!r} does not exist (a tokenizer.json or a model folder)")
    if (path / "tokenizer.json").is_file():
        return _from_file(path / "tokenizer.json")
    try:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(path, local_files_only=True)
        return Tokenizer.from_str(slow.backend_tokenizer.to_str())
    except ImportError:
        raise TokenizerError(f"data.tokenizer={str(spec)!r} has no tokenizer.json; reading its slow tokenizer "
                             f"files needs transformers (pip install transformers)") from None
    except (OSError, ValueError, AttributeError, TypeError, KeyError) as e:
        raise TokenizerError(f"data.tokenizer={str(spec)!r}: no tokenizer could be read from the folder "
                             f"({type(e).__name__}: {str(e)[:160]})") from None


def _from_file(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own exception types
        raise TokenizerError(f"tokenizer file {str(path)!r} is unreadable ({type(e).__name__}: "
                             f"{str(e)[:160]})") from None


def tokenizer_size(tok: Tokenizer) -> int:
    """Embedding rows the tokenizer's ids need: its largest id + 1 (added tokens included)."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def check_fits(tok: Tokenizer, vocab_size: int, where: str) -> None:
    """Refuse a tokenizer whose ids do not all fit ``model.vocab_size``."""
    size = tokenizer_size(tok)
    if size > vocab_size:
        raise TokenizerError(f"the tokenizer {where} has {size} tokens, more than model.vocab_size={vocab_size}; "
                             f"set model.vocab_size >= {size}")


def find_eot(tok: Tokenizer, spec: str | Path | None = None, eot_id: int | None = None) -> int:
    """The end-of-text id placed between documents: ``data.eot_id`` if set, else the folder's
    ``eos_token`` (``tokenizer_config.json``), else the first of :data:`EOT_NAMES` it knows."""
    if eot_id is not None:
        return eot_id
    names = list(EOT_NAMES)
    config = Path(spec).expanduser() / "tokenizer_config.json" if spec is not None else None
    if config is not None and config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str):
            names.insert(0, eos)
    for name in names:
        found = tok.token_to_id(name)
        if found is not None:
            return found
    raise TokenizerError(f"the tokenizer {str(spec)!r} has none of the end-of-text tokens {list(EOT_NAMES)}; "
                         f"set data.eot_id to the id placed between documents")


def tokenizer_digest(tok: Tokenizer) -> str:
    """SHA-256 of the tokenizer's JSON (part of a corpus cache's fingerprint)."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()


def checkpoint_tokenizer(ckpt_dir: str | Path, resume: str) -> tuple[Path | None, int | None]:
    """``(tokenizer.json, end-of-text id or None)`` of the checkpoint a run will resume
    (``checkpoint.resume``: ``auto`` or a path) when that tokenizer was given (``data.tokenizer``,
    ``seqpar import``) rather than trained by seqpar on a corpus; else ``(None, None)``. A path
    that names no complete checkpoint raises its error here, before any data work."""
    if resume == "never":
        return None, None
    if resume != "auto":
        from ..checkpoint.resume import named_checkpoint
        latest = named_checkpoint(resume)
    elif not Path(ckpt_dir).is_dir():
        return None, None
    else:
        from ..checkpoint.files import resume_order

        complete, _ = resume_order(ckpt_dir)  # the trainer warns about skipped ones itself
        latest = complete[0] if complete else None
    if latest is None or not (latest / "tokenizer.json").is_file():
        return None, None
    try:
        imported = "imported_from" in json.loads((latest / "extra.json").read_text())
        origin = json.loads((latest / ORIGIN_FILE).read_text()) if (latest / ORIGIN_FILE).is_file() else {}
    except (OSError, ValueError):
        return None, None
    origin = origin if isinstance(origin, dict) else {}
    if not (imported or origin.get("origin") == "given"):
        return None, None
    eot = origin.get("eot_id")
    return latest / "tokenizer.json", eot if isinstance(eot, int) else None
