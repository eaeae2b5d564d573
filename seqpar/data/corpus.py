"""Training data: a locally trained byte-level BPE and a cached, verified token memmap.

Corpus sources (``source`` argument):

* ``None``: the Python standard library's own ``.py`` files (no download), sorted by path.
* a text file, or a directory searched recursively for common text extensions (sorted).
* a token file (``.npy``, or raw ``.bin`` of ``uint16``/``uint32`` ids), used as is.

Text sources are capped at ``max_bytes``, tokenised with a BPE trained on them, and cached under
``cache_dir/corpus-<fingerprint>/`` (``tokenizer.json``, ``tokens.bin``, ``meta.json``). The
fingerprint covers file paths, sizes, mtimes, the vocabulary size and the byte cap; the cache
folder and the folders in ``exclude`` (a run's ``out_dir`` and checkpoint dir) are not part of the
corpus even when they sit inside the source.

The cache survives crashes and heals itself. Each file is written under a temporary name,
fsynced, renamed into place and its folder fsynced; ``meta.json`` comes last and records each
file's size and SHA-256. Opening verifies both files in one read (which also finds the largest
id, so every id is known to be ``< vocab_size``); :func:`prepare_corpus` rebuilds a folder that
fails (a truncated ``tokens.bin``, an empty or corrupt ``meta.json``), :func:`open_corpus` names
the problem. Token files are range-checked when opened, so batches cut from any corpus hold only
ids inside the vocabulary.

Under distributed training every rank calls :func:`prepare_corpus`: a file lock lets one process
build the cache while the others wait on the lock (no collective, so no process-group timeout
applies however long the build takes), then each opens the verified result. Batches are cut by
:mod:`seqpar.data.batches`.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from .cache import (CHUNK, EOT, Document, Log, build_cache, cache_problem, locked,  # noqa: F401
                           token_dtype)

MIN_VOCAB = 257  # 256 byte tokens + the end-of-text token
DEFAULT_MAX_BYTES = 8_000_000
TEXT_SUFFIXES = frozenset(".py .txt .md .rst .tex .c .h .cc .cpp .hpp .rs .go .js .ts .java .html .css .json "
                          ".yaml .yml .toml .cfg .ini .csv .sh".split())
TOKEN_SUFFIXES = frozenset({".bin", ".npy"})
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_FORMAT = 1  # bump to invalidate every cache entry


def default_cache_dir() -> Path:
    """``$SEQPAR_CACHE`` if set, else ``~/.cache/seqpar``."""
    return Path(os.environ.get("SEQPAR_CACHE") or "~/.cache/seqpar").expanduser()


def _walk(root: Path, skip: frozenset[str], excluded: frozenset[Path]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")
                       and Path(dirpath, d).resolve() not in excluded]
        found += [Path(dirpath, f) for f in filenames if Path(f).suffix.lower() in TEXT_SUFFIXES]
    return sorted(found)


def list_documents(source: str | Path | None, max_bytes: int = DEFAULT_MAX_BYTES,
                   exclude: Iterable[str | Path] = ()) -> list[Document]:
    """Text files of ``source`` in sorted order, keeping a prefix of at most ``max_bytes`` bytes;
    folders in ``exclude`` (and everything under them) are skipped."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    excluded = frozenset(Path(p).expanduser().resolve() for p in exclude)
    if source is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = [p for p in _walk(root, _SKIP_DIRS, excluded) if p.suffix == ".py"]
    else:
        root = Path(source)
        if root.is_dir():
            paths = _walk(root, frozenset({"__pycache__"}), excluded)
        elif root.is_file():
            paths = [root]
        else:
            raise FileNotFoundError(f"corpus source {str(root)!r} does not exist")
    docs, left = [], max_bytes
    for path in paths:
        st = path.stat()
        if st.st_size:
            docs.append(Document(path.resolve(), min(st.st_size, left), st.st_size, st.st_mtime_ns))
            left -= docs[-1].nbytes
        if left == 0:
            break
    if not docs:
        raise ValueError(f"corpus source {str(root)!r} holds no non-empty text files "
                         f"(extensions: {sorted(TEXT_SUFFIXES)})")
    return docs


def fingerprint(docs: Sequence[Document], vocab_size: int, max_bytes: int) -> str:
    """Hex digest identifying the cached tokenizer + tokens for these inputs."""
    key = [_FORMAT, vocab_size, max_bytes, [(str(d.path), d.size, d.mtime_ns) for d in docs]]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def _cache_base(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def prepare_corpus(source: str | Path | None = None, *, vocab_size: int, cache_dir: str | Path | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES, log: Log = print,
                   exclude: Iterable[str | Path] = ()) -> Corpus:
    """Train the tokenizer and encode the corpus unless a verified cache exists; return the opened corpus.

    Safe to call from every rank at once (one builds, the others wait on a file lock, then verify
    and reuse it). A cache that fails verification is rebuilt. Token files (``.bin``/``.npy``) are
    only checked and opened. ``exclude``: folders inside ``source`` that are not corpus.
    """
    if _is_token_file(source):
        return open_corpus(source, vocab_size=vocab_size, cache_dir=cache_dir, max_bytes=max_bytes)
    _check_vocab(vocab_size)
    base = _cache_base(cache_dir)
    docs = list_documents(source, max_bytes, exclude=(*exclude, base))
    fp = fingerprint(docs, vocab_size, max_bytes)
    base.mkdir(parents=True, exist_ok=True)
    folder = base / f"corpus-{fp[:16]}"
    with locked(base / f"corpus-{fp[:16]}.lock", log):
        meta, problem = cache_problem(folder, fp, vocab_size)
        if meta is None:
            if (folder / "meta.json").exists() or (folder / "tokens.bin").exists():
                log(f"data: rebuilding the corpus cache: {problem}")
            build_cache(folder, docs, fp, source, vocab_size, log)
            meta, problem = cache_problem(folder, fp, vocab_size)
            if meta is None:
                raise RuntimeError(f"the corpus cache just written fails its own check: {problem}")
    return _open_folder(folder, meta, vocab_size)


def open_corpus(source: str | Path | None = None, *, vocab_size: int, cache_dir: str | Path | None = None,
                max_bytes: int = DEFAULT_MAX_BYTES, exclude: Iterable[str | Path] = ()) -> Corpus:
    """Open an already prepared corpus read-only (no training, no writes, no lock), verified first."""
    if _is_token_file(source):  # any vocabulary larger than the ids it holds
        return _open_token_file(Path(source), vocab_size)
    _check_vocab(vocab_size)
    base = _cache_base(cache_dir)
    docs = list_documents(source, max_bytes, exclude=(*exclude, base))
    fp = fingerprint(docs, vocab_size, max_bytes)
    folder = base / f"corpus-{fp[:16]}"
    meta, problem = cache_problem(folder, fp, vocab_size)
    if meta is None:
        hint = (f"call prepare_corpus(...) with the same source, vocab_size, max_bytes and exclude "
                f"(it builds or rebuilds {str(folder)!r})")
        if not (folder / "meta.json").exists():
            raise FileNotFoundError(f"no prepared corpus in {str(folder)!r}; {hint}")
        raise ValueError(f"the corpus cache is unusable: {problem}; {hint}")
    return _open_folder(folder, meta, vocab_size)


def _check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB or vocab_size >= 2**32:
        raise ValueError(f"vocab_size must be an int in [{MIN_VOCAB}, 2**32) (256 bytes + EOT), got {vocab_size!r}")


def _is_token_file(source: str | Path | None) -> bool:
    return source is not None and Path(source).suffix.lower() in TOKEN_SUFFIXES


def _open_folder(folder: Path, meta: dict, vocab_size: int) -> Corpus:
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = np.memmap(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))
    return Corpus(tokens, vocab_size, tok, tok.token_to_id(EOT))


def _first_outside(tokens: np.ndarray, vocab_size: int) -> tuple[int, int] | None:
    """``(position, id)`` of the first id outside ``[0, vocab_size)``, or None; chunked."""
    step = CHUNK // max(1, tokens.dtype.itemsize)
    for lo in range(0, tokens.size, step):
        part = np.asarray(tokens[lo:lo + step])
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))
        if bad.size:
            return lo + int(bad[0]), int(part[bad[0]])
    return None


def _bin_dtype(path: Path, vocab_size: int) -> np.dtype:
    """The id type of a raw ``.bin``: from a ``meta.json`` beside it (checking the size it
    records), else the smallest type holding ``vocab_size`` ids."""
    meta_path = path.with_name("meta.json")
    if not meta_path.exists():
        return token_dtype(vocab_size)
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"token file {str(path)!r}: {str(meta_path)!r} beside it is unreadable "
                         f"({type(e).__name__}: {str(e)[:200]})") from None
    files = meta.get("files")
    record = files.get(path.name) if isinstance(files, dict) else None
    recorded = record.get("bytes") if isinstance(record, dict) else None
    if recorded is not None and recorded != path.stat().st_size:
        raise ValueError(f"token file {str(path)!r} has {path.stat().st_size} bytes, {str(meta_path)!r} records "
                         f"{recorded} (truncated?)")
    return dtype


def _open_token_file(path: Path, vocab_size: int) -> Corpus:
    """Open ``.npy`` or raw ``.bin`` ids, every id checked against ``vocab_size``; a
    ``tokenizer.json`` (and ``meta.json``) beside it is used if present."""
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    if path.suffix.lower() == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        dtype = _bin_dtype(path, vocab_size)
        if path.stat().st_size % dtype.itemsize:
            raise ValueError(f"token file {str(path)!r}: {path.stat().st_size} bytes is not a whole number "
                             f"of {dtype.name} ids")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.size == 0:
        raise ValueError(f"token file {str(path)!r} must hold a non-empty 1-D integer array, "
                         f"got shape {tokens.shape} dtype {tokens.dtype}")
    bad = _first_outside(tokens, vocab_size)
    if bad is not None:
        raise ValueError(f"token file {str(path)!r}: id {bad[1]} at position {bad[0]} is outside the vocabulary "
                         f"[0, {vocab_size}) (model.vocab_size)")
    tok_path = path.with_name("tokenizer.json")
    tok = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
    return Corpus(tokens, vocab_size, tok, tok.token_to_id(EOT) if tok is not None else None)


@dataclass(frozen=True)
class Corpus:
    """Token ids of a whole corpus (read-only memmap) and the tokenizer that made them."""

    tokens: np.ndarray  # [n] ids, all < vocab_size (checked when opened)
    vocab_size: int  # embedding rows the model needs (>= the tokenizer's own vocabulary)
    tokenizer: Tokenizer | None  # None for a bare token file
    eot_id: int | None

    def split(self, eval_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
        """``(train, heldout)`` views: the held-out part is the last ``eval_fraction`` of tokens."""
        if not 0.0 <= eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must lie in [0, 1), got {eval_fraction}")
        cut = len(self.tokens) - int(len(self.tokens) * eval_fraction)
        return self.tokens[:cut], self.tokens[cut:]

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this corpus was opened from a token file without a tokenizer.json beside it")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text).ids

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; end-of-text tokens are kept so document boundaries stay visible."""
        ids = ids.tolist() if isinstance(ids, (np.ndarray, torch.Tensor)) else list(ids)
        return self._tok().decode(ids, skip_special_tokens=False)
