"""Encoding a text cache in shards, by every process that wants the corpus, resumably.

The text's pieces are grouped into shards of about ``SHARD_BYTES`` of text. A corpus of one shard
is written as ``tokens.bin`` by the process holding the cache lock. A larger one is written as
``tokens-00000.bin``, ``tokens-00001.bin``, ...: every rank (and ``data.workers - 1`` helper
processes per rank) walks the shards and encodes each one it can lock (a per-shard ``flock``), so
the work spreads over all of them with no collective. Each shard is written under a temporary name
and renamed into place, then its record (``tokens-0000k.json``: fingerprint, tokenizer, size,
SHA-256) is written the same way; a shard with a matching record is finished and is reused after
a crash, anything else is encoded again. The cache's ``meta.json`` is written last, after every
shard has been read back and checked against its record. Documents are encoded in batches
(``encode_batch_fast``) and streamed to the shard, never the whole text in memory; documents are
joined by the end-of-text id, so the shards read one after another are the corpus's token sequence.
"""
from __future__ import annotations

import hashlib
import json
import multiprocessing
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from tokenizers import Tokenizer

from .cache import Log, atomic_write, cache_tokenizer, file_digest, token_dtype
from .lock import locked, try_lock
from .text import TextInput

SHARD_BYTES = 64 << 20  # text per shard; a corpus below it is one shard (tokens.bin)


@dataclass(frozen=True)
class ShardJob:
    """Everything a process needs to encode any shard of one cache (picklable)."""

    folder: Path
    fp: str
    tokenizer: str  # the tokenizer's JSON
    eot: int
    dtype: str
    shards: tuple[TextInput, ...]
    first_doc: tuple[int, ...]  # global index of each shard's first document

    def name(self, k: int) -> str:
        return "tokens.bin" if len(self.shards) == 1 else f"tokens-{k:05d}.bin"

    @property
    def tokenizer_sha(self) -> str:
        return hashlib.sha256(self.tokenizer.encode()).hexdigest()

    def record_path(self, k: int) -> Path:
        return self.folder / self.name(k).replace(".bin", ".json")

    def lock_path(self, k: int) -> Path:  # beside the folder: the folder holds only the cache's files
        return self.folder.with_name(f"{self.folder.name}.{self.name(k)}.lock")


def make_job(folder: Path, fp: str, tok: Tokenizer, eot: int, dtype: np.dtype, text: TextInput) -> ShardJob:
    """Group ``text``'s pieces into shards of about ``SHARD_BYTES``."""
    shards, group, size = [], [], 0
    for piece in text.pieces:
        if group and size + piece.nbytes > SHARD_BYTES:
            shards.append(TextInput(tuple(group)))
            group, size = [], 0
        group.append(piece)
        size += piece.nbytes
    shards.append(TextInput(tuple(group)))
    firsts = np.concatenate([[0], np.cumsum([s.documents for s in shards])[:-1]]).astype(int)
    return ShardJob(folder, fp, tok.to_str(), eot, np.dtype(dtype).name, tuple(shards), tuple(firsts.tolist()))


def encode_shard(job: ShardJob, k: int, tok: Tokenizer) -> dict:
    """Write shard ``k`` (and its record, for a corpus of several shards); return the record."""
    dtype, eot, doc = np.dtype(job.dtype), job.eot, job.first_doc[k]
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # no offsets: the ids are all we keep
    h, total, top = hashlib.sha256(), 0, -1

    def write(tmp: Path) -> None:
        nonlocal doc, total, top
        with open(tmp, "wb") as f:
            for texts in job.shards[k].batches():
                ids: list[int] = []
                for enc in encode(texts):  # with the tokenizer's own special tokens (e.g. a BOS)
                    if doc:
                        ids.append(eot)  # documents joined by the end-of-text id
                    ids += enc.ids
                    doc += 1
                block = np.array(ids, dtype=dtype)
                if block.size:
                    top = max(top, int(block.max()))
                h.update(block.tobytes())
                block.tofile(f)
                total += block.size

    atomic_write(job.folder / job.name(k), write)
    record = {"fingerprint": job.fp, "tokenizer": job.tokenizer_sha, "shard": k, "tokens": total,
              "bytes": total * dtype.itemsize, "sha256": h.hexdigest(), "max_id": top,
              "documents": job.shards[k].documents}
    if len(job.shards) > 1:
        atomic_write(job.record_path(k), lambda tmp: tmp.write_text(json.dumps(record)))
    return record


def shard_record(job: ShardJob, k: int) -> dict | None:
    """The record of a finished shard ``k`` of this job (same inputs, same tokenizer, the size it
    records on disk); None when it must be encoded (again)."""
    try:
        record = json.loads(job.record_path(k).read_text())
        size = (job.folder / job.name(k)).stat().st_size
    except (OSError, ValueError):
        return None
    same = isinstance(record, dict) and record.get("fingerprint") == job.fp and record.get("shard") == k
    if not same or record.get("tokenizer") != job.tokenizer_sha or record.get("bytes") != size:
        return None
    return record


@contextmanager
def _try_lock(path: Path) -> Iterator[bool]:
    with open(path, "a+") as f:
        mine = try_lock(f)
        try:
            yield mine
        finally:
            if mine:
                f.truncate(0)  # released: no stale name for the next waiter


def _claim(job: ShardJob, tok: Tokenizer, on_done=None) -> None:
    """Encode every unfinished shard nobody else holds."""
    for k in range(len(job.shards)):
        if shard_record(job, k) is not None:
            continue
        with _try_lock(job.lock_path(k)) as mine:
            if mine and shard_record(job, k) is None:
                encode_shard(job, k, tok)
                if on_done is not None:
                    on_done()


def _helper(job: ShardJob) -> None:
    _claim(job, Tokenizer.from_str(job.tokenizer))


class _Progress:
    """``data: tokenized 7/13 shards (120.3/200.0 MB), 35.1 MB/s, ETA 0m03s`` lines."""

    def __init__(self, job: ShardJob, log: Log):
        self.job, self.log, self.t0 = job, log, time.perf_counter()
        self.before = self._done_bytes()

    def _done_bytes(self) -> tuple[int, int]:
        done = [k for k in range(len(self.job.shards)) if shard_record(self.job, k) is not None]
        return len(done), sum(self.job.shards[k].nbytes for k in done)

    def __call__(self) -> None:
        shards, nbytes = self._done_bytes()
        total = sum(s.nbytes for s in self.job.shards)
        rate = (nbytes - self.before[1]) / max(time.perf_counter() - self.t0, 1e-9)
        eta = (total - nbytes) / rate if rate > 0 else float("inf")
        when = f"{int(eta // 60)}m{int(eta % 60):02d}s" if eta != float("inf") else "?"
        self.log(f"data: tokenized {shards}/{len(self.job.shards)} shards ({nbytes / 1e6:.1f}/{total / 1e6:.1f} MB), "
                 f"{rate / 1e6:.1f} MB/s, ETA {when}")


def encode_shards(job: ShardJob, workers: int, log: Log, timeout_s: float | None = None) -> None:
    """Encode the job's unfinished shards with this process and ``workers - 1`` helpers (spawned),
    alongside whatever other processes (ranks) do the same; return once every shard is finished.
    A shard whose encoder died is encoded here; one held longer than ``timeout_s`` seconds fails
    naming its lock and holder."""
    tok, progress = Tokenizer.from_str(job.tokenizer), _Progress(job, log)
    ctx = multiprocessing.get_context("spawn")
    helpers = [ctx.Process(target=_helper, args=(job,), daemon=True) for _ in range(workers - 1)]
    for p in helpers:
        p.start()
    try:
        _claim(job, tok, progress)
        for k in range(len(job.shards)):  # wait for the shards others hold; take over any they left
            with locked(job.lock_path(k), None, timeout_s=timeout_s, what=f"encoding shard {k}"):
                if shard_record(job, k) is None:
                    encode_shard(job, k, tok)
            progress()
    except BaseException:
        for p in helpers:  # a shard a helper leaves unfinished is encoded again by whoever comes next
            p.terminate()
        raise
    finally:
        for p in helpers:
            p.join()


def verified_files(job: ShardJob) -> dict[str, dict]:
    """``{shard name: {"bytes", "sha256", "max_id"}}`` of a job of several shards, read back from
    disk, each shard re-encoded first when it does not match its record (damaged since)."""
    tok, files = Tokenizer.from_str(job.tokenizer), {}
    for k in range(len(job.shards)):
        record = shard_record(job, k)
        got = file_digest(job.folder / job.name(k), np.dtype(job.dtype))
        if record is None or got is None or got["sha256"] != record["sha256"]:
            encode_shard(job, k, tok)
            got = file_digest(job.folder / job.name(k), np.dtype(job.dtype))
        files[job.name(k)] = got
    return files


def start_cache(folder: Path, text: TextInput, fp: str, vocab_size: int, log: Log, tokenizer: Tokenizer | None = None,
                eot_id: int | None = None) -> ShardJob:
    """Under the cache lock: the tokenizer in place, ``meta.json`` removed (the folder reads as
    incomplete from here on), the shards planned. A corpus of one shard is encoded right away;
    returns the :class:`ShardJob` (``tokens.bin`` already written when it
    has a single shard)."""
    folder.mkdir(exist_ok=True)
    tok, eot = cache_tokenizer(folder, text, vocab_size, log, tokenizer, eot_id)
    (folder / "meta.json").unlink(missing_ok=True)
    job = make_job(folder, fp, tok, eot, token_dtype(vocab_size), text)
    if len(job.shards) == 1:
        n = encode_shard(job, 0, tok)["tokens"]
        log(f"data: encoded {text.documents} documents ({text.nbytes / 1e6:.1f} MB), {n:,} tokens")
    return job


def finish_cache(job: ShardJob, source: str | Path | None, vocab_size: int, log: Log, given: bool) -> None:
    """Under the cache lock, every shard finished: check each shard against its record, then write
    ``meta.json`` (last) recording every file's size and SHA-256."""
    folder, dtype = job.folder, np.dtype(job.dtype)
    shards = verified_files(job) if len(job.shards) > 1 else {"tokens.bin": file_digest(folder / "tokens.bin")}
    n = sum(d["bytes"] for d in shards.values()) // dtype.itemsize
    tok = Tokenizer.from_str(job.tokenizer)
    meta = {"fingerprint": job.fp, "source": str(source or "<stdlib>"), "documents": job.first_doc[-1]
            + job.shards[-1].documents, "vocab_size": vocab_size, "tokenizer_vocab_size": tok.get_vocab_size(),
            "dtype": dtype.name, "tokens": n, "eot_id": job.eot, "tokenizer": "given" if given else "trained",
            "shards": list(shards), "files": {"tokenizer.json": file_digest(folder / "tokenizer.json"),
                                              **{k: {"bytes": v["bytes"], "sha256": v["sha256"]}
                                                 for k, v in shards.items()}}}
    atomic_write(folder / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    log(f"data: wrote {n:,} tokens to {folder}" + (f" ({len(shards)} shards)" if len(shards) > 1 else ""))
