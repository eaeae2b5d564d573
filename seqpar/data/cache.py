"""The prepared-corpus cache folder: crash-safe writes, verification on open, (re)building.

A folder ``corpus-<fingerprint>/`` holds ``tokenizer.json``, ``tokens.bin`` (raw ids) and
``meta.json``. Each file is written under a temporary name, fsynced, renamed into place and the
folder fsynced; ``meta.json`` comes last and records each file's size and SHA-256, so a folder
either verifies completely (:func:`cache_problem`) or is rebuilt (:func:`build_cache`). The
policy (when to build, what to tell the user) lives in :mod:`seqpar.data.corpus`; the lock that
lets one process build it, in :mod:`seqpar.data.lock`.
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
from tokenizers import ByteLevelBPETokenizer, Tokenizer

from .text import TextInput

EOT = "<|endoftext|>"
CHUNK = 1 << 24  # bytes read at a time when verifying (a multiple of every id size)
Log = Callable[[str], None]


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab <= 65535), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)``, fsync it, rename it over ``path``, fsync the folder: after a crash ``path``
    is the old file or the complete new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def file_digest(path: Path, dtype: np.dtype | None = None) -> dict | None:
    """``{"bytes", "sha256"}`` of ``path`` (plus ``"max_id"`` when ``dtype`` is given) in one
    chunked read; None when the file is missing."""
    h, nbytes, top = hashlib.sha256(), 0, -1
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return None
    with f:
        while block := f.read(CHUNK):
            h.update(block)
            nbytes += len(block)
            if dtype is not None and len(block) >= dtype.itemsize:
                ids = np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize)
                top = max(top, int(ids.max()))
    out = {"bytes": nbytes, "sha256": h.hexdigest()}
    return out | {"max_id": top} if dtype is not None else out


def cache_problem(folder: Path, fp: str, vocab_size: int) -> tuple[dict | None, str | None]:
    """``(meta, None)`` when ``folder`` holds a complete cache of fingerprint ``fp`` whose ids all
    lie below ``vocab_size``; else ``(None, what is wrong)``. Reads every byte of every file."""
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        return None, f"{meta_path} is missing"
    try:
        meta = json.loads(meta_path.read_text())
        dtype, n, files = np.dtype(meta["dtype"]), int(meta["tokens"]), meta["files"]
        shards = [str(name) for name in meta.get("shards", ["tokens.bin"])]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{meta_path} is unreadable or incomplete ({type(e).__name__}: {str(e)[:200]})"
    if meta.get("fingerprint") != fp:
        return None, f"{meta_path} describes other inputs"
    nbytes = 0
    for name in ("tokenizer.json", *shards):
        want = files.get(name) if isinstance(files, dict) else None
        got = file_digest(folder / name, dtype if name != "tokenizer.json" else None)
        if got is None or not isinstance(want, dict):
            return None, f"{folder / name} is missing or not recorded in meta.json"
        if got["bytes"] != want.get("bytes"):
            return None, f"{folder / name} has {got['bytes']} bytes, meta.json records {want.get('bytes')}"
        if got["sha256"] != want.get("sha256"):
            return None, f"{folder / name} does not match the SHA-256 recorded in meta.json"
        if name != "tokenizer.json":
            nbytes += got["bytes"]
            if got["max_id"] >= vocab_size:
                return None, f"{folder / name} holds id {got['max_id']}, outside the vocabulary [0, {vocab_size})"
    if nbytes != n * dtype.itemsize:
        return None, f"{meta_path} records {n} tokens of {dtype.name} but the token files have {nbytes} bytes"
    return meta, None


def _train_tokenizer(text: TextInput, vocab_size: int, out: Path, log: Log) -> Tokenizer:
    log(f"data: training byte-level BPE (vocab {vocab_size}) on {text.documents} documents, "
        f"{text.nbytes / 1e6:.1f} MB")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator((t for batch in text.batches() for t in batch), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOT], show_progress=False, length=text.documents)
    atomic_write(out, lambda tmp: bpe.save(str(tmp)))
    log(f"data: tokenizer with {bpe.get_vocab_size()} tokens saved to {out}")
    return Tokenizer.from_file(str(out))


def _reusable_tokenizer(folder: Path, log: Log) -> Tokenizer | None:
    """The tokenizer of an earlier build that stopped after training it (``meta.json`` absent, or
    recording this very file); None when there is none or it cannot be trusted."""
    tok_path, meta_path = folder / "tokenizer.json", folder / "meta.json"
    if not tok_path.is_file():
        return None
    if meta_path.exists():
        try:
            recorded = json.loads(meta_path.read_text())["files"]["tokenizer.json"]["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if recorded != file_digest(tok_path)["sha256"]:
            return None
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception:  # noqa: BLE001 - any unreadable tokenizer is retrained
        return None
    log(f"data: reusing tokenizer {tok_path}")
    return tok


def cache_tokenizer(folder: Path, text: TextInput, vocab_size: int, log: Log, given: Tokenizer | None,
               eot_id: int | None) -> tuple[Tokenizer, int]:
    """The cache's tokenizer and end-of-text id: ``given`` (saved into the folder), else one an
    earlier build left and meta.json does not contradict, else a BPE trained on ``text``."""
    if given is not None:
        atomic_write(folder / "tokenizer.json", lambda tmp: given.save(str(tmp)))
        return given, eot_id
    tok = _reusable_tokenizer(folder, log) or _train_tokenizer(text, vocab_size, folder / "tokenizer.json", log)
    return tok, tok.token_to_id(EOT)
