"""Tokenization throughput of seqpar's text cache build against the tokenizer's own limit.

Generates a text corpus (``--mb`` MB in ``--dir``, files of about 50 KB of Zipf-distributed words),
trains a byte-level BPE on a 4 MB sample of it, then measures, each in a fresh process:

* ``encode_batch`` and ``encode_batch_fast`` of ``tokenizers`` on the whole text already in memory,
  256 documents a call, in one process: the limit a builder can reach;
* ``prepare_corpus(..., tokenizer=..., workers=N)`` into an empty cache for each ``--workers`` N:
  reading the files, encoding, writing and verifying the shards, and the final ``meta.json``.

Prints a table: MB of text per second, the ratio to ``encode_batch`` (in all and per process),
per process to ``encode_batch_fast`` (what the builder calls), and the peak RSS of the process
(its helpers' largest RSS in brackets). ``RAYON_NUM_THREADS`` (the
threads ``tokenizers`` uses inside one process) is passed through; ``--threads 1`` sets it to 1.

    python scripts/bench/tokenize_throughput.py --mb 200 --workers 1 2
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

WORDS = 20_000


def make_corpus(folder: Path, mb: int, seed: int = 0) -> int:
    """``mb`` MB of text in files of about 50 KB; returns the bytes written (reused when present)."""
    import numpy as np

    marker = folder / ".complete"
    if marker.is_file() and int(marker.read_text()) >= mb << 20:
        return int(marker.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(WORDS)]
    ranks = 1.0 / np.arange(1, WORDS + 1)
    p = ranks / ranks.sum()
    total, i = 0, 0
    while total < mb << 20:
        words = np.asarray(vocab, dtype=object)[rng.choice(WORDS, 8000, p=p)]
        lines = [" ".join(words[j:j + 12]) + ("." if j % 5 else ".\n") for j in range(0, len(words), 12)]
        text = " ".join(lines)
        (folder / f"{i // 1000:03d}").mkdir(exist_ok=True)
        (folder / f"{i // 1000:03d}" / f"doc{i:06d}.txt").write_text(text)
        total, i = total + len(text.encode()), i + 1
    marker.write_text(str(total))
    return total


def train_tokenizer(folder: Path, out: Path, vocab: int) -> None:
    from tokenizers.implementations import ByteLevelBPETokenizer

    files = sorted(folder.rglob("*.txt"))[:80]  # about 4 MB
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator((f.read_text() for f in files), vocab_size=vocab, special_tokens=["<|endoftext|>"],
                            show_progress=False)
    bpe.save(str(out))


def _rss_mb(who: int) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def child_limit(corpus: str, tok_path: str, fast: bool) -> dict:
    """Encode every file already read into memory, 256 documents a call, one process."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    texts = [p.read_text() for p in sorted(Path(corpus).rglob("*.txt"))]
    nbytes = sum(len(t.encode()) for t in texts)
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) for i in range(0, len(texts), 256) for e in encode(texts[i:i + 256]))
    return {"seconds": time.perf_counter() - t0, "bytes": nbytes, "tokens": tokens, "rss": _rss_mb(resource.RUSAGE_SELF)}


def child_build(corpus: str, tok_path: str, workers: int, cache: str) -> dict:
    """prepare_corpus into an empty cache: read, encode, write and verify the shards, meta.json."""
    from tokenizers import Tokenizer

    from seqpar.data import prepare_corpus

    tok = Tokenizer.from_file(tok_path)
    t0 = time.perf_counter()
    c = prepare_corpus(corpus, vocab_size=tok.get_vocab_size() + 1, cache_dir=cache, max_bytes=1 << 40,
                       tokenizer=tok, eot_id=tok.token_to_id("<|endoftext|>"), workers=workers, log=lambda _: None)
    seconds = time.perf_counter() - t0
    meta = json.loads(next(Path(cache).glob("corpus-*/meta.json")).read_text())
    return {"seconds": seconds, "tokens": len(c.tokens), "shards": len(meta["shards"]),
            "rss": _rss_mb(resource.RUSAGE_SELF), "helper_rss": _rss_mb(resource.RUSAGE_CHILDREN)}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", *args], check=True, capture_output=True, text=True,
                         env=os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--dir", default="/tmp/seqpar-tokenize-bench")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--threads", type=int, default=None, help="RAYON_NUM_THREADS for every process")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        kind, *rest = args.child
        result = (child_limit(rest[0], rest[1], rest[2] == "fast") if kind == "limit"
                  else child_build(rest[0], rest[1], int(rest[2]), rest[3]))
        print(json.dumps(result))
        return
    if args.threads is not None:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    root = Path(args.dir)
    corpus, tok_path = root / "corpus", root / "tokenizer.json"
    nbytes = make_corpus(corpus, args.mb)
    if not tok_path.is_file():
        train_tokenizer(corpus, tok_path, args.vocab)
    mb = nbytes / 1e6
    limit = run_child("limit", str(corpus), str(tok_path), "plain")
    fast = run_child("limit", str(corpus), str(tok_path), "fast")
    base = mb / limit["seconds"]
    print(f"corpus {mb:.0f} MB in {len(list(corpus.rglob('*.txt')))} files, {limit['tokens']:,} tokens; "
          f"cpus {os.cpu_count()}, RAYON_NUM_THREADS={os.environ.get('RAYON_NUM_THREADS', 'default')}")
    print(f"{'what':<42} {'processes':>9} {'MB/s':>7} {'vs encode_batch':>15} {'per process':>11} "
          f"{'vs _fast':>8} {'peak RSS MB':>12}")
    rows = [("tokenizers encode_batch (in memory)", 1, base, limit["rss"], None),
            ("tokenizers encode_batch_fast (in memory)", 1, mb / fast["seconds"], fast["rss"], None)]
    for n in args.workers:
        cache = root / f"cache-w{n}"
        shutil.rmtree(cache, ignore_errors=True)
        got = run_child("build", str(corpus), str(tok_path), str(n), str(cache))
        assert got["tokens"] >= limit["tokens"], (got, limit)  # + one end-of-text id between documents
        rows.append((f"seqpar cache build, {got['shards']} shards", n, mb / got["seconds"], got["rss"],
                     got["helper_rss"] if n > 1 else None))
        shutil.rmtree(cache, ignore_errors=True)
    fast_rate = rows[1][2]
    for what, n, rate, rss, helper in rows:
        rss_text = f"{rss:.0f}" + (f" ({helper:.0f})" if helper else "")
        print(f"{what:<42} {n:>9} {rate:>7.1f} {rate / base:>14.2f}x {rate / base / n:>10.2f}x "
              f"{rate / fast_rate / n:>7.2f}x {rss_text:>12}")


if __name__ == "__main__":
    main()
