"""Token sources read in place: one ``.npy``/``.bin`` file, a folder of token shards, a Megatron
indexed dataset (``prefix.bin`` + ``prefix.idx``). Nothing is converted or copied.

A folder of shards is one token sequence cut into files (sorted by name; each file memory-mapped). A
Megatron dataset is read through its index: the ``.idx`` file holds the magic ``MMIDIDX\\x00\\x00``,
version 1 (``<Q``), a dtype code (``<B``), the sequence count and document count (``<Q`` each),
then ``int32`` sequence lengths, ``int64`` byte pointers into the ``.bin`` and the ``int64``
document index (the first sequence of each document, ending with the sequence count). Its
documents are joined by an end-of-text id, unless they already end with it. Every id is checked
against the vocabulary when the source is opened.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .cache import CHUNK, token_dtype
from .errors import DataError

TOKEN_SUFFIXES = frozenset({".bin", ".npy"})
IDX_MAGIC = b"MMIDIDX\x00\x00"
IDX_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
              8: np.uint16}


class TokenSequence:
    """Segments of memory-mapped id arrays read as one 1-D sequence, an end-of-text id before each
    segment whose ``sep`` is set. ``seq[a:b]`` is a view (nothing read); ``np.asarray`` of a
    view reads its ids (as ``dtype``, the segments' common type)."""

    def __init__(self, bases: list[np.ndarray], base: np.ndarray, lo: np.ndarray, hi: np.ndarray,
                 sep: np.ndarray, eot: int | None, window: tuple[int, int] | None = None):
        self.bases, self._base, self._lo, self._sep, self.eot = bases, base, lo, sep.astype(bool), eot
        self._start = np.concatenate([[0], np.cumsum(hi - lo + self._sep)]).astype(np.int64)
        self.window = window or (0, int(self._start[-1]))
        kinds = [b.dtype for b in bases] + ([np.min_scalar_type(eot)] if eot is not None and sep.any() else [])
        self.dtype = np.result_type(*kinds)

    ndim = 1

    def __len__(self) -> int:
        return self.window[1] - self.window[0]

    @property
    def size(self) -> int:
        return len(self)

    def __getitem__(self, key):
        if isinstance(key, slice):
            a, b, step = key.indices(len(self))
            if step != 1:
                raise IndexError("TokenSequence: only contiguous slices")
            lo = self.window[0] + a
            view = object.__new__(TokenSequence)
            view.__dict__.update(self.__dict__, window=(lo, lo + max(0, b - a)))
            return view
        i = int(key) + (len(self) if int(key) < 0 else 0)
        if not 0 <= i < len(self):
            raise IndexError(f"TokenSequence index {key} out of range for length {len(self)}")
        return int(self._read(self.window[0] + i, self.window[0] + i + 1)[0])

    def _read(self, lo: int, hi: int) -> np.ndarray:
        pos = np.arange(lo, hi, dtype=np.int64)
        seg = np.searchsorted(self._start, pos, side="right") - 1
        off = pos - self._start[seg]
        is_eot = self._sep[seg] & (off == 0)
        raw = self._lo[seg] + off - self._sep[seg]
        out = np.full(len(pos), -1 if self.eot is None else self.eot, dtype=np.int64)
        for b in np.unique(self._base[seg[~is_eot]]):
            m = ~is_eot & (self._base[seg] == b)
            out[m] = self.bases[b][raw[m]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._read(*self.window).astype(dtype or self.dtype, copy=False)

    def doc_starts(self) -> np.ndarray:
        """Stream positions where a segment (a document, for indexed datasets) begins, in this view."""
        starts = self._start[:-1] + self._sep
        inside = (starts >= self.window[0]) & (starts < self.window[1])
        return starts[inside] - self.window[0]


def first_outside(tokens: np.ndarray, vocab_size: int) -> tuple[int, int] | None:
    """``(position, id)`` of the first id outside ``[0, vocab_size)``, or None; chunked."""
    step = CHUNK // max(1, tokens.dtype.itemsize)
    for lo in range(0, tokens.size, step):
        part = np.asarray(tokens[lo:lo + step])
        bad = np.flatnonzero((part < 0) | (part >= vocab_size))
        if bad.size:
            return lo + int(bad[0]), int(part[bad[0]])
    return None


def check_ids(tokens: np.ndarray, vocab_size: int, path: Path) -> None:
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.size == 0:
        raise DataError(f"token file {str(path)!r} must hold a non-empty 1-D integer array, "
                        f"got shape {tokens.shape} dtype {tokens.dtype}")
    bad = first_outside(tokens, vocab_size)
    if bad is not None:
        raise DataError(f"token file {str(path)!r}: id {bad[1]} at position {bad[0]} is outside the vocabulary "
                        f"[0, {vocab_size}) (model.vocab_size)")


def bin_dtype(path: Path, vocab_size: int) -> np.dtype:
    """The id type of a raw ``.bin``: from a ``meta.json`` beside it (checking the size it
    records), else the smallest type holding ``vocab_size`` ids."""
    meta_path = path.with_name("meta.json")
    if not meta_path.exists():
        return token_dtype(vocab_size)
    try:
        meta = json.loads(meta_path.read_text())
        dtype = np.dtype(meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"token file {str(path)!r}: {str(meta_path)!r} beside it is unreadable "
                        f"({type(e).__name__}: {str(e)[:200]})") from None
    files = meta.get("files")
    record = files.get(path.name) if isinstance(files, dict) else None
    recorded = record.get("bytes") if isinstance(record, dict) else None
    if recorded is not None and recorded != path.stat().st_size:
        raise DataError(f"token file {str(path)!r} has {path.stat().st_size} bytes, {str(meta_path)!r} records "
                        f"{recorded} (truncated?)")
    return dtype


def map_ids(path: Path, vocab_size: int) -> np.ndarray:
    """One ``.npy`` or raw ``.bin`` file memory-mapped, every id checked against ``vocab_size``."""
    try:
        if path.suffix.lower() == ".npy":
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        else:
            dtype = bin_dtype(path, vocab_size)
            if path.stat().st_size % dtype.itemsize:
                raise DataError(f"token file {str(path)!r}: {path.stat().st_size} bytes is not a whole number "
                                f"of {dtype.name} ids")
            tokens = np.memmap(path, dtype=dtype, mode="r") if path.stat().st_size else np.zeros(0, dtype)
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"token file {str(path)!r} is unreadable ({type(e).__name__}: {str(e)[:160]})") from None
    check_ids(tokens, vocab_size, path)
    return tokens


def open_shards(folder: Path, vocab_size: int) -> TokenSequence:
    """The ``.bin``/``.npy`` files of ``folder`` (sorted by name) as one sequence, no separators added."""
    paths = shard_files(folder)
    if not paths:
        raise DataError(f"token folder {str(folder)!r} holds no .bin/.npy shards")
    return joined([map_ids(p, vocab_size) for p in paths])


def joined(bases: list[np.ndarray]) -> TokenSequence:
    """Id arrays read one after another as one sequence, nothing added between them."""
    n = len(bases)
    return TokenSequence(bases, np.arange(n), np.zeros(n, np.int64), np.array([len(b) for b in bases], np.int64),
                         np.zeros(n, bool), None)


def shard_files(folder: Path) -> list[Path]:
    """The token shards of ``folder``: its ``.bin``/``.npy`` files, sorted by name."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in TOKEN_SUFFIXES
                  and not p.name.startswith("."))


def read_index(idx: Path, bin_bytes: int) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """``(dtype, token starts of the sequences, document index)`` of a Megatron ``.idx``, checked
    against its ``.bin`` of ``bin_bytes`` bytes."""
    raw = idx.read_bytes()
    head = len(IDX_MAGIC) + 8 + 1 + 8 + 8
    if len(raw) < head or raw[:len(IDX_MAGIC)] != IDX_MAGIC:
        raise DataError(f"{str(idx)!r} is not a Megatron index (header {raw[:9]!r}, want {IDX_MAGIC!r})")
    version, code, n, docs = struct.unpack_from("<QBQQ", raw, len(IDX_MAGIC))
    if version != 1 or code not in IDX_DTYPES or IDX_DTYPES[code] in (np.float32, np.float64):
        raise DataError(f"{str(idx)!r}: version {version} / dtype code {code} is not supported "
                        f"(version 1, integer dtype codes {[c for c in IDX_DTYPES if c < 6 or c == 8]})")
    dtype = np.dtype(IDX_DTYPES[code])
    want = head + 12 * n + 8 * docs
    if len(raw) not in (want, want + n):  # + n: the multimodal sequence modes
        raise DataError(f"{str(idx)!r} has {len(raw)} bytes; {n} sequences and {docs} documents need {want}")
    lengths = np.frombuffer(raw, np.int32, n, head).astype(np.int64)
    pointers = np.frombuffer(raw, np.int64, n, head + 4 * n)
    doc_idx = np.frombuffer(raw, np.int64, docs, head + 12 * n)
    expect = np.concatenate([[0], np.cumsum(lengths * dtype.itemsize)])
    if not np.array_equal(pointers, expect[:-1]) or expect[-1] != bin_bytes:
        raise DataError(f"{str(idx)!r} does not match its .bin: the index describes {int(expect[-1])} bytes of "
                        f"{dtype.name} ids, the .bin has {bin_bytes}")
    if docs < 1 or doc_idx[0] != 0 or doc_idx[-1] != n or np.any(np.diff(doc_idx) < 0):
        raise DataError(f"{str(idx)!r}: the document index must rise from 0 to the sequence count {n}")
    return dtype, expect[:-1] // dtype.itemsize, doc_idx


def open_indexed(prefix: Path, vocab_size: int, eot_id: int | None) -> TokenSequence:
    """A Megatron indexed dataset as one sequence of its documents, joined by ``eot_id`` (inferred
    when every document already ends with the same id)."""
    bin_path, idx = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    for p in (bin_path, idx):
        if not p.is_file():
            raise DataError(f"indexed dataset {str(prefix)!r}: {str(p)!r} is missing")
    dtype, starts, doc_idx = read_index(idx, bin_path.stat().st_size)
    if bin_path.stat().st_size == 0:
        raise DataError(f"indexed dataset {str(bin_path)!r} holds no tokens")
    ids = np.memmap(bin_path, dtype=dtype, mode="r")
    check_ids(ids, vocab_size, bin_path)
    ends = np.append(starts, len(ids))
    lo, hi = ends[doc_idx[:-1]], ends[doc_idx[1:]]
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    last = np.asarray(ids[hi - 1], dtype=np.int64)
    if eot_id is None and len(lo) == 1:
        return TokenSequence([ids], np.zeros(1, np.int64), lo, hi, np.zeros(1, bool), None)
    if eot_id is None:
        if len(np.unique(last)) != 1:
            raise DataError(f"indexed dataset {str(prefix)!r}: no end-of-text id known to join its {len(lo)} "
                            f"documents; set data.eot_id (or data.tokenizer)")
        eot_id = int(last[0])
    if not 0 <= eot_id < vocab_size:
        raise DataError(f"data.eot_id={eot_id} is outside the vocabulary [0, {vocab_size})")
    sep = np.concatenate([[False], last[:-1] != eot_id])
    return TokenSequence([ids], np.zeros(len(lo), np.int64), lo, hi, sep, eot_id)


def indexed_prefix(source: Path) -> Path | None:
    """The prefix of a Megatron dataset named by ``prefix``, ``prefix.bin`` or ``prefix.idx``
    (its ``.idx`` exists), else None. A prefix may itself hold dots (``corpus.v1``)."""
    if source.suffix.lower() in (".bin", ".idx") and source.with_suffix(".idx").is_file():
        return source.with_suffix("")
    return source if Path(f"{source}.idx").is_file() else None
