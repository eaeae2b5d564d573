"""Training data: a verified token memmap from text (a given tokenizer, or a locally trained
byte-level BPE) or read in place from token files.

Corpus sources (``source`` argument):

* ``None``: the Python standard library's own ``.py`` files (no download), sorted by path.
* a text file, or a directory searched recursively for common text extensions (sorted).
* Hugging Face ``datasets`` files (``.jsonl``, ``.parquet``, ``.arrow``; a file or a folder of
  them, or a ``Dataset.save_to_disk`` folder): each record's ``text_field`` is a document (:mod:`.records`).
* a token file (``.npy``, or raw ``.bin`` of ``uint16``/``uint32`` ids), a folder of such shards,
  or a Megatron indexed dataset (``prefix`` with ``prefix.bin`` + ``prefix.idx``), used in place
  (:mod:`.tokens`).

A folder of data files skips the README, licence and metadata files beside them and refuses any
other mix (:mod:`.kinds`).

Text sources are capped at ``max_bytes`` (datasets files are not), tokenised with ``tokenizer``
when given, else with a BPE trained on them, and cached under ``cache_dir/corpus-<fingerprint>/``
(``tokenizer.json``, ``tokens.bin``, ``meta.json``); documents are joined by the end-of-text id.
The fingerprint covers file paths, sizes, mtimes, the vocabulary size, the byte cap and the
tokenizer; the cache folder and the folders in ``exclude`` (a run's ``out_dir`` and checkpoint
dir) are not part of the corpus even when they sit inside the source.

The cache survives crashes and heals itself. Each file is written under a temporary name,
fsynced, renamed into place and its folder fsynced; ``meta.json`` comes last and records each
file's size and SHA-256. Opening verifies both files in one read (which also finds the largest
id, so every id is known to be ``< vocab_size``); :func:`prepare_corpus` rebuilds a folder that
fails (a truncated ``tokens.bin``, an empty or corrupt ``meta.json``), :func:`open_corpus` names
the problem. Token files are range-checked when opened, so batches cut from any corpus hold only
ids inside the vocabulary.

Under distributed training every rank calls :func:`prepare_corpus`: a file lock lets one process
build the cache while the others wait on the lock (no collective), then each opens the verified
result. A waiter names the holder (a rank of its own job, or another process's pid and host) and
gives up after ``lock_timeout_s`` (the run's ``parallel.timeout_minutes``), naming the lock file
and the holder (:mod:`seqpar.data.lock`). Batches are cut by
:mod:`seqpar.data.batches`.
"""
from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

from .cache import EOT, Log, cache_problem
from .lock import locked
from .shards import encode_shards, finish_cache, start_cache
from .text import Document, TextInput, file_input
from .errors import DataError
from .kinds import TEXT_SUFFIXES, classify, resolved, source_kind, walk_text
from .records import record_files, record_input
from .tokenizer import tokenizer_digest
from .tokens import indexed_prefix, joined, map_ids, open_indexed, open_shards

MIN_VOCAB = 257  # 256 byte tokens + the end-of-text token
DEFAULT_MAX_BYTES = 8_000_000
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_FORMAT = 1  # bump to invalidate every cache entry


class MissingSource(DataError, FileNotFoundError):
    """A corpus source that does not exist."""


def default_cache_dir() -> Path:
    """``$SEQPAR_CACHE`` if set, else ``~/.cache/seqpar``."""
    return Path(os.environ.get("SEQPAR_CACHE") or "~/.cache/seqpar").expanduser()


def list_documents(source: str | Path | None, max_bytes: int = DEFAULT_MAX_BYTES,
                   exclude: Iterable[str | Path] = ()) -> list[Document]:
    """Text files of ``source`` in sorted order, keeping a prefix of at most ``max_bytes`` bytes;
    folders in ``exclude`` (and everything under them) are skipped."""
    if max_bytes <= 0:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")
    excluded = resolved(exclude)
    if source is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = [p for p in walk_text(root, _SKIP_DIRS, excluded) if p.suffix == ".py"]
    else:
        root = Path(source)
        if root.is_dir():
            paths = walk_text(root, frozenset({"__pycache__"}), excluded)
        elif root.is_file():
            paths = [root]
        else:
            raise MissingSource(f"corpus source {str(root)!r} does not exist")
    docs, left = [], max_bytes
    for path in paths:
        st = path.stat()
        if st.st_size:
            docs.append(Document(path.resolve(), min(st.st_size, left), st.st_size, st.st_mtime_ns))
            left -= docs[-1].nbytes
        if left == 0:
            break
    if not docs:
        raise DataError(f"corpus source {str(root)!r} holds no non-empty text files "
                        f"(extensions: {sorted(TEXT_SUFFIXES)})")
    return docs


def fingerprint(docs: Sequence[Document], vocab_size: int, max_bytes: int, tokenizer: str | None = None) -> str:
    """Hex digest identifying the cached tokenizer + tokens for these inputs (``tokenizer``: the
    digest of a given tokenizer and its end-of-text id; None when the BPE is trained)."""
    key = [_FORMAT, vocab_size, max_bytes, [(str(d.path), d.size, d.mtime_ns) for d in docs]]
    return hashlib.sha256(json.dumps(key + ([tokenizer] if tokenizer else [])).encode()).hexdigest()


def _cache_base(cache_dir: str | Path | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


@dataclass(frozen=True)
class TextPlan:
    """A text source's cache folder and what builds it."""

    folder: Path
    fp: str
    load: Callable[[], TextInput]  # the text, opened only when the cache is (re)built
    capped: bool = False  # max_bytes cut the source short


def _text_plan(source, vocab_size: int, base: Path, max_bytes: int, exclude, tokenizer: Tokenizer | None,
               eot_id: int | None, text_field: str) -> TextPlan:
    given = f"{tokenizer_digest(tokenizer)}:{eot_id}" if tokenizer is not None else None
    skip = (*exclude, base)
    if source_kind(source, skip) == "records":  # a verified cache needs no datasets package
        files = record_files(Path(source).expanduser(), resolved(skip))
        docs = [Document(p.resolve(), p.stat().st_size, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        fp = fingerprint(docs, vocab_size, 0, f"{given}:{text_field}")
        return TextPlan(base / f"corpus-{fp[:16]}", fp, lambda: record_input(files, text_field, base / "datasets"))
    docs = list_documents(source, max_bytes, exclude=skip)
    fp = fingerprint(docs, vocab_size, max_bytes, given)
    capped = source is not None and sum(d.nbytes for d in docs) >= max_bytes
    return TextPlan(base / f"corpus-{fp[:16]}", fp, lambda: file_input(docs), capped)


def prepare_corpus(source: str | Path | None = None, *, vocab_size: int, cache_dir: str | Path | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES, log: Log = print, exclude: Iterable[str | Path] = (),
                   tokenizer: Tokenizer | None = None, eot_id: int | None = None, text_field: str = "text",
                   workers: int = 1, lock_timeout_s: float | None = None) -> Corpus:
    """Encode the corpus unless a verified cache exists (training a BPE first when no
    ``tokenizer`` is given); return the opened corpus. ``lock_timeout_s``: the longest wait for a
    lock another process holds (None: no limit), then :class:`DataError` names it and its holder.

    Safe to call from every rank at once: the tokenizer is trained once under the cache's file
    lock; a corpus of one shard is encoded there too (the others wait, then verify and reuse it),
    a larger one by every caller at once, each with ``workers`` processes
    (:mod:`seqpar.data.shards`). A cache that fails verification is rebuilt, keeping the shards
    that still match their records. Token sources are only checked and opened. ``exclude``:
    folders inside ``source`` that are not corpus.
    """
    base = _cache_base(cache_dir)
    kind, side = classify(source, (*exclude, base))
    if side:
        log(f"data: {str(source)!r}: skipping {', '.join(p.name for p in side)} beside the data files")
    if kind not in ("text", "records"):
        return _open_tokens(Path(source), kind, vocab_size, tokenizer, eot_id)
    _check_vocab(vocab_size)
    plan = _text_plan(source, vocab_size, base, max_bytes, exclude, tokenizer, eot_id, text_field)
    if plan.capped:
        log(f"data: reading only the first {max_bytes:,} bytes of {str(source)!r} (data.max_bytes); "
            f"raise it to read more")
    base.mkdir(parents=True, exist_ok=True)
    lock, given = base / f"{plan.folder.name}.lock", tokenizer is not None
    with locked(lock, log, timeout_s=lock_timeout_s):
        meta, problem = cache_problem(plan.folder, plan.fp, vocab_size)
        ready = meta is not None  # built before (or by another rank): say what it holds, once here
        if meta is None:
            if (plan.folder / "meta.json").exists() or (plan.folder / "tokens.bin").exists():
                log(f"data: rebuilding the corpus cache: {problem}")
            job = start_cache(plan.folder, plan.load(), plan.fp, vocab_size, log, tokenizer, eot_id)
            if len(job.shards) == 1:
                meta = _finish(job, source, vocab_size, log, given)
    if meta is None:  # several shards: every caller encodes them, outside the lock
        encode_shards(job, workers, log, timeout_s=lock_timeout_s)
        with locked(lock, log, timeout_s=lock_timeout_s):
            meta, problem = cache_problem(plan.folder, plan.fp, vocab_size)
            if meta is None:
                meta = _finish(job, source, vocab_size, log, given)
    if ready:
        log(f"data: {meta.get('documents', '?')} documents, {int(meta['tokens']):,} tokens (cache {plan.folder})")
    return _open_folder(plan.folder, meta, vocab_size, given=tokenizer is not None)


def _finish(job, source, vocab_size: int, log: Log, given: bool) -> dict:
    finish_cache(job, source, vocab_size, log, given)
    meta, problem = cache_problem(job.folder, job.fp, vocab_size)
    if meta is None:
        raise RuntimeError(f"the corpus cache just written fails its own check: {problem}")
    return meta


def open_corpus(source: str | Path | None = None, *, vocab_size: int, cache_dir: str | Path | None = None,
                max_bytes: int = DEFAULT_MAX_BYTES, exclude: Iterable[str | Path] = (),
                tokenizer: Tokenizer | None = None, eot_id: int | None = None, text_field: str = "text") -> Corpus:
    """Open an already prepared corpus read-only (no training, no writes, no lock), verified first."""
    kind = source_kind(source, (*exclude, _cache_base(cache_dir)))
    if kind in ("tokens", "shards", "indexed"):  # any vocabulary larger than the ids they hold
        return _open_tokens(Path(source), kind, vocab_size, tokenizer, eot_id)
    _check_vocab(vocab_size)
    plan = _text_plan(source, vocab_size, _cache_base(cache_dir), max_bytes, exclude, tokenizer, eot_id, text_field)
    meta, problem = cache_problem(plan.folder, plan.fp, vocab_size)
    if meta is None:
        hint = (f"call prepare_corpus(...) with the same source, vocab_size, max_bytes, exclude and tokenizer "
                f"(it builds or rebuilds {str(plan.folder)!r})")
        if not (plan.folder / "meta.json").exists():
            raise MissingSource(f"no prepared corpus in {str(plan.folder)!r}; {hint}")
        raise DataError(f"the corpus cache is unusable: {problem}; {hint}")
    return _open_folder(plan.folder, meta, vocab_size, given=tokenizer is not None)


def _check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB or vocab_size >= 2**32:
        raise DataError(f"vocab_size must be an int in [{MIN_VOCAB}, 2**32) (256 bytes + EOT), got {vocab_size!r}")


def _open_folder(folder: Path, meta: dict, vocab_size: int, given: bool = False) -> Corpus:
    """A verified cache: ``tokens.bin`` memory-mapped, or its shards read as one sequence."""
    tok, dtype = Tokenizer.from_file(str(folder / "tokenizer.json")), np.dtype(meta["dtype"])
    shards = meta.get("shards", ["tokens.bin"])
    maps = [np.memmap(folder / name, dtype=dtype, mode="r") for name in shards]
    tokens = maps[0] if len(maps) == 1 else joined(maps)
    eot = meta.get("eot_id", tok.token_to_id(EOT))
    return Corpus(tokens, vocab_size, tok, eot, given)


def _open_tokens(path: Path, kind: str, vocab_size: int, tokenizer: Tokenizer | None,
                 eot_id: int | None) -> Corpus:
    """A token file, a folder of shards or a Megatron dataset, every id checked against
    ``vocab_size``; without a given tokenizer a ``tokenizer.json`` beside the ids is used."""
    if kind == "indexed":
        prefix = indexed_prefix(path)
        tokens, side = open_indexed(prefix, vocab_size, eot_id), prefix.with_name("tokenizer.json")
    elif kind == "shards":
        tokens, side = open_shards(path, vocab_size), path / "tokenizer.json"
    else:
        if not path.is_file():
            raise MissingSource(f"token file {str(path)!r} does not exist")
        tokens, side = map_ids(path, vocab_size), path.with_name("tokenizer.json")
    tok = tokenizer if tokenizer is not None else (Tokenizer.from_file(str(side)) if side.is_file() else None)
    if eot_id is None:
        eot_id = getattr(tokens, "eot", None)
    if eot_id is None and tok is not None:
        eot_id = tok.token_to_id(EOT)
    return Corpus(tokens, vocab_size, tok, eot_id, tokenizer is not None)


@dataclass(frozen=True)
class Corpus:
    """Token ids of a whole corpus (read-only memmap or :class:`~seqpar.data.tokens.TokenSequence`)
    and the tokenizer that made them."""

    tokens: np.ndarray  # [n] ids, all < vocab_size (checked when opened)
    vocab_size: int  # embedding rows the model needs (>= the tokenizer's own vocabulary)
    tokenizer: Tokenizer | None  # None for bare token files
    eot_id: int | None
    tokenizer_given: bool = False  # True: data.tokenizer or a checkpoint's, not a BPE trained here
    # a blend (data.sources): its sources' corpora, normalised weights and names; ``tokens`` then
    # reads them one after another (:class:`~seqpar.data.blend.Joined`)
    parts: tuple[Corpus, ...] = ()
    weights: tuple[float, ...] = ()
    names: tuple[str, ...] = ()

    def split(self, eval_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
        """``(train, heldout)`` views: the held-out part is the last ``eval_fraction`` of tokens."""
        if not 0.0 <= eval_fraction < 1.0:
            raise DataError(f"eval_fraction must lie in [0, 1), got {eval_fraction}")
        cut = len(self.tokens) - int(len(self.tokens) * eval_fraction)
        return self.tokens[:cut], self.tokens[cut:]

    def opening(self, n: int = 3, window: int = 1 << 16) -> str:
        """A prompt from the data: the first ``n`` tokens of the first document that starts (after an
        end-of-text) in the held-out tail's first ``window`` tokens, else of the corpus's first document."""
        tail = np.asarray(self.split()[1][:window])
        starts = np.flatnonzero(tail[:-n] == self.eot_id) + 1 if self.eot_id is not None and len(tail) > n else []
        return self.decode(tail[int(starts[0]):int(starts[0]) + n] if len(starts) else self.tokens[:n])

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise DataError("this corpus was opened from a token file without a tokenizer.json beside it "
                            "(set data.tokenizer)")
        return self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tok().encode(text).ids

    def decode(self, ids: Sequence[int] | np.ndarray | torch.Tensor) -> str:
        """Text of ``ids``; end-of-text tokens are kept so document boundaries stay visible."""
        ids = ids.tolist() if isinstance(ids, (np.ndarray, torch.Tensor)) else list(ids)
        return self._tok().decode(ids, skip_special_tokens=False)
