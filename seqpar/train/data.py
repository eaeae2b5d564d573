"""Training data: a locally trained byte-level BPE, a cached token memmap, and seeded batches.

Corpus sources (``source`` argument):

* ``None``: the Python standard library's own ``.py`` files (no download), sorted by path.
* a text file, or a directory searched recursively for common text extensions (sorted).
* a token file (``.npy``, or raw ``.bin`` of ``uint16``/``uint32`` ids), used as is.

Text sources are capped at ``max_bytes``, tokenised with a BPE trained on them, and cached under
``cache_dir/corpus-<fingerprint>/`` (``tokenizer.json``, ``tokens.bin``, ``meta.json``). The
fingerprint covers file paths, sizes, mtimes, the vocabulary size and the byte cap. Under
distributed training call :func:`prepare_corpus` on one rank, barrier, then :func:`open_corpus`
on the others; concurrent ``prepare_corpus`` calls are also safe (file lock, atomic renames).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer, Tokenizer

EOT = "<|endoftext|>"
MIN_VOCAB = 257  # 256 byte tokens + the end-of-text token
DEFAULT_MAX_BYTES = 8_000_000
TEXT_SUFFIXES = frozenset(".py .txt .md .rst .tex .c .h .cc .cpp .hpp .rs .go .js .ts .java .html .css .json "
                          ".yaml .yml .toml .cfg .ini .csv .sh".split())
TOKEN_SUFFIXES = frozenset({".bin", ".npy"})
_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
_FORMAT = 1  # bump to invalidate every cache entry
Log = Callable[[str], None]


def default_cache_dir() -> Path:
    """``$SEQPAR_CACHE`` if set, else ``~/.cache/seqpar``."""
    return Path(os.environ.get("SEQPAR_CACHE") or "~/.cache/seqpar").expanduser()


def token_dtype(vocab_size: int) -> np.dtype:
    """``uint16`` when every id fits (vocab <= 65535), else ``uint32``."""
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


@dataclass(frozen=True)
class Document:
    path: Path
    nbytes: int  # bytes read from the start of the file (the last file may be cut by the cap)
    size: int
    mtime_ns: int


def _walk(root: Path, skip: frozenset[str]) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")]
        found += [Path(dirpath, f) for f in filenames if Path(f).suffix.lower() in TEXT_SUFFIXES]
    return sorted(found)


def list_documents(source: str | Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Document]:
    """Text files of ``source`` in sorted order, keeping a prefix of at most ``max_bytes`` bytes."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    if source is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        paths = [p for p in _walk(root, _SKIP_DIRS) if p.suffix == ".py"]
    else:
        root = Path(source)
        if root.is_dir():
            paths = _walk(root, frozenset({"__pycache__"}))
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


def _read(doc: Document) -> str:
    with open(doc.path, "rb") as f:
        return f.read(doc.nbytes).decode("utf-8", errors="replace")  # a cut may split a character


def fingerprint(docs: Sequence[Document], vocab_size: int, max_bytes: int) -> str:
    """Hex digest identifying the cached tokenizer + tokens for these inputs."""
    key = [_FORMAT, vocab_size, max_bytes, [(str(d.path), d.size, d.mtime_ns) for d in docs]]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # waits while another rank prepares this corpus; freed on close
        yield


def _train_tokenizer(docs: list[Document], vocab_size: int, out: Path, log: Log) -> Tokenizer:
    log(f"data: training byte-level BPE (vocab {vocab_size}) on {len(docs)} files, "
        f"{sum(d.nbytes for d in docs) / 1e6:.1f} MB")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator((_read(d) for d in docs), vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOT], show_progress=False, length=len(docs))
    _atomic(out, lambda tmp: bpe.save(str(tmp)))
    log(f"data: tokenizer with {bpe.get_vocab_size()} tokens saved to {out}")
    return Tokenizer.from_file(str(out))


def _encode_corpus(docs: list[Document], tok: Tokenizer, dtype: np.dtype, out: Path, log: Log,
                   chunk: int = 256) -> int:
    eot, total, done = tok.token_to_id(EOT), 0, 0

    def write(tmp: Path) -> None:
        nonlocal total, done
        with open(tmp, "wb") as f:
            for start in range(0, len(docs), chunk):
                batch = docs[start:start + chunk]
                for i, enc in enumerate(tok.encode_batch([_read(d) for d in batch])):
                    ids = enc.ids if start + i == 0 else [eot, *enc.ids]  # documents joined by EOT
                    np.asarray(ids, dtype=dtype).tofile(f)
                    total += len(ids)
                done += sum(d.nbytes for d in batch)
                log(f"data: encoded {start + len(batch)}/{len(docs)} files ({done / 1e6:.1f} MB), {total:,} tokens")

    _atomic(out, write)
    return total


def prepare_corpus(source: str | Path | None = None, *, vocab_size: int, cache_dir: str | Path | None = None,
                   max_bytes: int = DEFAULT_MAX_BYTES, log: Log = print) -> Corpus:
    """Train the tokenizer and encode the corpus unless cached; return the opened corpus.

    Safe to call from several processes at once (one does the work, the others wait on a lock
    and then reuse it). Token files (``.bin``/``.npy``) are only checked and opened.
    """
    if _is_token_file(source):
        return open_corpus(source, vocab_size=vocab_size, cache_dir=cache_dir, max_bytes=max_bytes)
    _check_vocab(vocab_size)
    docs = list_documents(source, max_bytes)
    fp = fingerprint(docs, vocab_size, max_bytes)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    base.mkdir(parents=True, exist_ok=True)
    folder = base / f"corpus-{fp[:16]}"
    with _locked(base / f"corpus-{fp[:16]}.lock"):
        if _meta(folder, fp) is None:
            folder.mkdir(exist_ok=True)
            tok_path, dtype = folder / "tokenizer.json", token_dtype(vocab_size)
            if tok_path.exists():  # an earlier run stopped after training: keep its tokenizer
                tok = Tokenizer.from_file(str(tok_path))
                log(f"data: reusing tokenizer {tok_path}")
            else:
                tok = _train_tokenizer(docs, vocab_size, tok_path, log)
            n = _encode_corpus(docs, tok, dtype, folder / "tokens.bin", log)
            meta = {"fingerprint": fp, "source": str(source or "<stdlib>"), "files": len(docs),
                    "vocab_size": vocab_size, "tokenizer_vocab_size": tok.get_vocab_size(), "dtype": dtype.name,
                    "tokens": n}
            _atomic(folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
            log(f"data: wrote {n:,} tokens to {folder}")
    return _open_folder(folder, fp, vocab_size)


def open_corpus(source: str | Path | None = None, *, vocab_size: int, cache_dir: str | Path | None = None,
                max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """Open an already prepared corpus read-only (no training, no writes, no lock)."""
    if _is_token_file(source):  # any vocabulary larger than the ids it holds
        return _open_token_file(Path(source), vocab_size)
    _check_vocab(vocab_size)
    docs = list_documents(source, max_bytes)
    fp = fingerprint(docs, vocab_size, max_bytes)
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _open_folder(base / f"corpus-{fp[:16]}", fp, vocab_size)


def _check_vocab(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB or vocab_size >= 2**32:
        raise ValueError(f"vocab_size must be an int in [{MIN_VOCAB}, 2**32) (256 bytes + EOT), got {vocab_size!r}")


def _is_token_file(source: str | Path | None) -> bool:
    return source is not None and Path(source).suffix.lower() in TOKEN_SUFFIXES


def _meta(folder: Path, fp: str) -> dict | None:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        return None
    return meta if meta.get("fingerprint") == fp else None


def _open_folder(folder: Path, fp: str, vocab_size: int) -> Corpus:
    meta = _meta(folder, fp)
    if meta is None:
        raise FileNotFoundError(f"no prepared corpus in {str(folder)!r}; call prepare_corpus(...) on one rank "
                                f"(before a barrier) with the same source, vocab_size and max_bytes")
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = np.memmap(folder / "tokens.bin", dtype=np.dtype(meta["dtype"]), mode="r", shape=(meta["tokens"],))
    return Corpus(tokens, vocab_size, tok, tok.token_to_id(EOT))


def _open_token_file(path: Path, vocab_size: int) -> Corpus:
    """Open ``.npy`` or raw ``.bin`` ids; a ``tokenizer.json`` (and ``meta.json``) beside it is used if present."""
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    meta_path, tok_path = path.with_name("meta.json"), path.with_name("tokenizer.json")
    if path.suffix.lower() == ".npy":
        tokens = np.load(path, mmap_mode="r")
    else:
        dtype = np.dtype(json.loads(meta_path.read_text())["dtype"]) if meta_path.exists() else token_dtype(vocab_size)
        if path.stat().st_size % dtype.itemsize:
            raise ValueError(f"token file {str(path)!r}: {path.stat().st_size} bytes is not a whole number "
                             f"of {dtype.name} ids")
        tokens = np.memmap(path, dtype=dtype, mode="r")
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.size == 0:
        raise ValueError(f"token file {str(path)!r} must hold a non-empty 1-D integer array, "
                         f"got shape {tokens.shape} dtype {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"token file {str(path)!r} holds ids in [{lo}, {hi}], outside vocab_size {vocab_size}")
    tok = Tokenizer.from_file(str(tok_path)) if tok_path.exists() else None
    return Corpus(tokens, vocab_size, tok, tok.token_to_id(EOT) if tok is not None else None)


@dataclass(frozen=True)
class Corpus:
    """Token ids of a whole corpus (read-only memmap) and the tokenizer that made them."""

    tokens: np.ndarray  # [n] ids, all < vocab_size
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


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = np.stack([np.asarray(tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    x = torch.from_numpy(rows)  # [b, s + 1]
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def _check_split(tokens: np.ndarray, seq_len: int, micro_batch: int, dp_rank: int, dp_size: int, what: str) -> None:
    if seq_len < 1 or micro_batch < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"{what}: need seq_len >= 1, micro_batch >= 1, 0 <= dp_rank < dp_size; got seq_len="
                         f"{seq_len} micro_batch={micro_batch} dp_rank={dp_rank} dp_size={dp_size}")
    if len(tokens) < seq_len + 1:
        raise ValueError(f"{what}: {len(tokens)} tokens are fewer than seq_len + 1 = {seq_len + 1}")


class TokenBatches:
    """Random ``seq_len + 1`` windows of ``tokens`` as ``(inputs, labels)`` int64 ``[micro_batch, seq_len]``.

    Micro-step ``k`` draws ``micro_batch * dp_size`` window starts from
    ``Generator(PCG64([seed, k]))``; DP rank ``r`` takes slice ``r``. Batches therefore do not
    depend on TP rank, differ across DP ranks, and a dp=2 run sees exactly the windows of a dp=1
    run with twice the micro-batch. The only state is the micro-step counter, so resuming from
    :meth:`state_dict` continues the same stream.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        _check_split(tokens, seq_len, micro_batch, dp_rank, dp_size, "TokenBatches")
        self.tokens, self.seq_len, self.micro_batch = tokens, seq_len, micro_batch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        self.step = 0

    def starts(self, step: int) -> np.ndarray:
        """Window starts of this DP rank at micro-step ``step``."""
        rng = np.random.Generator(np.random.PCG64([self.seed, step]))
        everyone = rng.integers(0, len(self.tokens) - self.seq_len, size=self.micro_batch * self.dp_size)
        return everyone[self.dp_rank * self.micro_batch:(self.dp_rank + 1) * self.micro_batch]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _windows(self.tokens, self.starts(step), self.seq_len)

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"TokenBatches: checkpoint seed {state.get('seed')!r} differs from seed {self.seed}")
        self.step = int(state["step"])


def eval_batches(tokens: np.ndarray, *, seq_len: int, micro_batch: int, num_batches: int,
                 dp_rank: int = 0, dp_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed evaluation batches: ``num_batches * micro_batch * dp_size`` windows spread evenly over
    ``tokens`` (the held-out split); DP rank ``r`` takes slice ``r`` of each batch. No randomness."""
    _check_split(tokens, seq_len, micro_batch, dp_rank, dp_size, "eval_batches")
    if num_batches < 1:
        raise ValueError(f"eval_batches: num_batches must be >= 1, got {num_batches}")
    per_batch = micro_batch * dp_size
    starts = np.linspace(0, len(tokens) - seq_len - 1, num_batches * per_batch).astype(np.int64)
    lo = dp_rank * micro_batch
    return [_windows(tokens, starts[b * per_batch + lo:b * per_batch + lo + micro_batch], seq_len)
            for b in range(num_batches)]
