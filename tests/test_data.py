"""Data pipeline: tokenizer/token cache (verified, self-healing), held-out split, seeded batches cut
from one global batch per step, resume."""
from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from seqpar.data import (EOT, Corpus, TokenBatches, default_cache_dir, eval_batches, list_documents,
                               open_corpus, prepare_corpus)

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu é ü → def return".split()
TEXT_FILES = ["a/b.txt", "a/c.md", "d.py", "sub/deep/e.rst"]
VOCAB = 300


def make_corpus(root: Path, lines: int = 150) -> Path:
    rng = random.Random(0)
    for i, name in enumerate(TEXT_FILES):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) + f" {i}" for _ in range(lines)))
    (root / "image.png").write_bytes(bytes(range(256)))  # not a text extension: ignored
    (root / ".hidden").mkdir()
    (root / ".hidden" / "x.txt").write_text("hidden")  # hidden directory: ignored
    (root / "empty.txt").write_text("")  # empty: skipped
    return root


def collect() -> tuple[list[str], object]:
    lines: list[str] = []
    return lines, lines.append


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    return make_corpus(tmp_path / "corpus")


def test_documents_sorted_filtered_and_capped(corpus_dir):
    docs = list_documents(corpus_dir)
    assert [d.path for d in docs] == sorted((corpus_dir / n).resolve() for n in TEXT_FILES)
    full = sum(d.size for d in docs)
    capped = list_documents(corpus_dir, max_bytes=full - 100)
    assert sum(d.nbytes for d in capped) == full - 100 and capped[-1].nbytes == capped[-1].size - 100
    assert len(list_documents(corpus_dir, max_bytes=10)) == 1


def test_prepare_encodes_documents_joined_by_eot(corpus_dir, tmp_path):
    corpus = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=tmp_path / "cache", log=lambda s: None)
    texts = [d.path.read_text() for d in list_documents(corpus_dir)]
    assert corpus.tokens.dtype == np.uint16 and int(corpus.tokens.max()) < VOCAB
    assert int((corpus.tokens == corpus.eot_id).sum()) == len(texts) - 1
    assert corpus.decode(corpus.tokens) == EOT.join(texts)  # byte-level BPE round-trips exactly
    sample = "def gamma(): return → é"
    assert corpus.decode(corpus.encode(sample)) == sample
    assert corpus.decode(torch.tensor(corpus.encode(sample))) == sample


def test_cache_reused_without_retraining(corpus_dir, tmp_path):
    cache = tmp_path / "cache"
    logs, log = collect()
    first = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=log)
    assert any("training byte-level BPE" in line for line in logs) and any("encoded" in line for line in logs)
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    assert set(mtimes) == {"tokenizer.json", "tokens.bin", "meta.json"}
    logs.clear()
    second = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=log)
    assert len(logs) == 1 and logs[0].startswith("data: 4 documents, ") and str(folder) in logs[0], logs
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
    reader = open_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache)
    assert np.array_equal(first.tokens, second.tokens) and np.array_equal(first.tokens, reader.tokens)
    assert json.loads((folder / "meta.json").read_text())["tokens"] == len(first.tokens)


def test_fingerprint_tracks_content_vocab_and_cap(corpus_dir, tmp_path):
    cache = tmp_path / "cache"
    quiet = dict(cache_dir=cache, log=lambda s: None)
    prepare_corpus(corpus_dir, vocab_size=VOCAB, **quiet)
    prepare_corpus(corpus_dir, vocab_size=VOCAB + 20, **quiet)
    prepare_corpus(corpus_dir, vocab_size=VOCAB, max_bytes=5000, **quiet)
    (corpus_dir / "d.py").write_text("changed content\n")
    logs, log = collect()
    prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=log)
    assert any("training" in line for line in logs)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 4


def test_run_folders_inside_the_source_are_not_corpus(corpus_dir, tmp_path):
    cache, out, ckpt = corpus_dir / "cache", corpus_dir / "runs", corpus_dir / "ckpt"
    kw = dict(vocab_size=VOCAB, cache_dir=cache, exclude=(out, ckpt))
    first = prepare_corpus(corpus_dir, log=lambda s: None, **kw)
    for folder in (out, ckpt / "step_00000001"):  # what a run writes there: configs, json, a tokenizer
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("train:\n  steps: 1\n")
        (folder / "tokenizer.json").write_text("{}")
    logs, log = collect()
    again = prepare_corpus(corpus_dir, log=log, **kw)
    assert [ln.split(",")[0] for ln in logs] == ["data: 4 documents"], logs  # reused: nothing rebuilt
    assert np.array_equal(first.tokens, again.tokens)
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1
    assert [d.path for d in list_documents(corpus_dir, exclude=(cache, out, ckpt))] == \
        sorted((corpus_dir / n).resolve() for n in TEXT_FILES)


def _folder(cache: Path) -> Path:
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    return folder


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_cache_is_named_by_readers_and_rebuilt_by_prepare(corpus_dir, tmp_path):
    cache = tmp_path / "cache"
    expected = np.array(prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=lambda s: None).tokens)
    folder = _folder(cache)
    meta, tokens = folder / "meta.json", folder / "tokens.bin"
    damages = {  # what power loss or a full disk leaves behind -> what a reader is told
        "truncated tokens.bin": (lambda: os.truncate(tokens, 100), r"tokens\.bin has 100 bytes, meta\.json records"),
        "empty meta.json": (lambda: meta.write_text(""), r"meta\.json is unreadable"),
        "corrupt meta.json": (lambda: meta.write_text('{"fingerprint": '), r"meta\.json is unreadable"),
        "a flipped bit": (lambda: _flip_byte(tokens, 10), r"tokens\.bin does not match the SHA-256"),
        "an older meta.json": (lambda: meta.write_text(json.dumps({k: v for k, v in json.loads(
            meta.read_text()).items() if k != "files"})), r"meta\.json is unreadable or incomplete"),
    }
    for what, (damage, message) in damages.items():
        damage()
        with pytest.raises(ValueError, match=message):
            open_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache)
        logs, log = collect()
        healed = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=log)
        assert any("rebuilding the corpus cache" in line for line in logs), (what, logs)
        assert np.array_equal(healed.tokens, expected), what
        assert np.array_equal(open_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache).tokens, expected), what
        if what == "a flipped bit":  # the tokenizer is recorded intact in meta.json: kept, not retrained
            assert any("reusing tokenizer" in line for line in logs) and not any("training" in x for x in logs)


def test_cache_ids_are_range_checked_when_opened(corpus_dir, tmp_path):
    """A cache that verifies but holds an id outside the vocabulary is refused (and rebuilt)."""
    cache = tmp_path / "cache"
    expected = np.array(prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=lambda s: None).tokens)
    folder = _folder(cache)
    forged = expected.copy()
    forged[7] = 4000
    forged.tofile(folder / "tokens.bin")
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["tokens.bin"]["sha256"] = hashlib.sha256(forged.tobytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"tokens\.bin holds id 4000, outside the vocabulary \[0, 300\)"):
        open_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache)
    healed = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=cache, log=lambda s: None)
    assert np.array_equal(healed.tokens, expected)


def test_cache_files_are_fsynced_and_meta_comes_last(corpus_dir, tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=tmp_path / "cache", log=lambda s: None)
    folder = str(_folder(tmp_path / "cache"))
    files = [Path(p).name.split(".tmp")[0] for p in synced if p != folder]
    assert [f.rsplit(".", 2)[0] for f in files] == [".tokenizer.json", ".tokens.bin", ".meta.json"], synced
    assert synced.count(folder) == 3, "the folder is synced after each rename"


def test_open_before_prepare_errors(corpus_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare_corpus"):
        open_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=tmp_path / "cache")


def test_concurrent_prepare_trains_once(corpus_dir, tmp_path):
    logs, log = collect()
    results: list[Corpus] = []
    threads = [threading.Thread(target=lambda: results.append(
        prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=tmp_path / "cache", log=log))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and sum("training" in line for line in logs) == 1
    assert all(np.array_equal(r.tokens, results[0].tokens) for r in results)


def test_stdlib_default_corpus(tmp_path):
    docs = list_documents(None, max_bytes=300_000)
    assert sum(d.nbytes for d in docs) == 300_000
    assert [d.path for d in docs] == sorted(d.path for d in docs)
    assert all(d.path.suffix == ".py" and "site-packages" not in d.path.parts for d in docs)
    corpus = prepare_corpus(None, vocab_size=512, cache_dir=tmp_path, max_bytes=300_000, log=lambda s: None)
    assert len(corpus.tokens) > 50_000 and int(corpus.tokens.max()) < 512
    code = "def f(x):\n    return x + 1\n"
    assert len(corpus.encode(code)) < len(code.encode()) and corpus.decode(corpus.encode(code)) == code


def test_default_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SEQPAR_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("SEQPAR_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "seqpar"


def test_token_file_inputs(tmp_path, corpus_dir):
    ids = (np.arange(5000) * 7) % 1000
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    ids.astype(np.uint16).tofile(tmp_path / "ids.bin")
    for name in ("ids.npy", "ids.bin"):
        corpus = prepare_corpus(tmp_path / name, vocab_size=1000, cache_dir=tmp_path / "cache")
        assert np.array_equal(corpus.tokens, ids) and corpus.tokenizer is None
        assert np.array_equal(open_corpus(tmp_path / name, vocab_size=1000).tokens, ids)
    with pytest.raises(ValueError, match="without a tokenizer.json"):
        corpus.encode("x")
    with pytest.raises(ValueError, match=r"ids\.npy': id 504 at position 72 is outside the vocabulary \[0, 500\)"):
        open_corpus(tmp_path / "ids.npy", vocab_size=500)
    with pytest.raises(ValueError, match=r"ids\.bin': id 999 at position 857 is outside the vocabulary \[0, 999\)"):
        prepare_corpus(tmp_path / "ids.bin", vocab_size=999, cache_dir=tmp_path / "cache")
    (tmp_path / "odd.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"odd\.bin'.*not a whole number of uint16"):
        open_corpus(tmp_path / "odd.bin", vocab_size=1000)
    prepared = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=tmp_path / "cache", log=lambda s: None)
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    reopened = open_corpus(folder / "tokens.bin", vocab_size=VOCAB)  # the tokenizer beside it is picked up
    assert np.array_equal(reopened.tokens, prepared.tokens) and reopened.decode([reopened.eot_id]) == EOT


def test_bad_paths_and_vocab(tmp_path):
    for fn in (prepare_corpus, open_corpus):
        with pytest.raises(FileNotFoundError, match=r"missing\.txt"):
            fn(tmp_path / "missing.txt", vocab_size=VOCAB, cache_dir=tmp_path)
        with pytest.raises(FileNotFoundError, match=r"missing\.bin"):
            fn(tmp_path / "missing.bin", vocab_size=VOCAB, cache_dir=tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty' holds no non-empty text files"):
        prepare_corpus(tmp_path / "empty", vocab_size=VOCAB, cache_dir=tmp_path)
    for bad in (256, 10, 300.0):
        with pytest.raises(ValueError, match=rf"vocab_size must be an int in \[257.*got {bad}"):
            prepare_corpus(tmp_path, vocab_size=bad, cache_dir=tmp_path)


def test_split_is_disjoint_tail(corpus_dir, tmp_path):
    corpus = prepare_corpus(corpus_dir, vocab_size=VOCAB, cache_dir=tmp_path, log=lambda s: None)
    train, held = corpus.split(0.05)
    n = len(corpus.tokens)
    assert len(held) == int(n * 0.05) > 0 and len(train) + len(held) == n
    assert np.array_equal(np.concatenate([train, held]), corpus.tokens)
    batches = TokenBatches(train, seq_len=32, micro_batch=4, seed=0)
    assert max(int(batches.starts(k).max()) for k in range(200)) + 32 + 1 <= len(train)  # never reads held-out
    evals = eval_batches(held, seq_len=32, micro_batch=2, num_batches=3)
    assert np.array_equal(evals[0][0][0].numpy(), held[:32]) and np.array_equal(evals[-1][1][-1].numpy(), held[-32:])
    assert len(corpus.split(0.0)[1]) == 0
    with pytest.raises(ValueError, match="eval_fraction must lie in \\[0, 1\\), got 1.5"):
        corpus.split(1.5)


TOKENS = np.arange(10_000, dtype=np.uint16)  # token id == position, so inputs[:, 0] is the window start


def test_batch_shapes_and_shift():
    (x, y), = next(TokenBatches(TOKENS, seq_len=16, micro_batch=3, seed=1))
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)


def test_batches_depend_on_the_ids_not_on_how_they_are_held(tmp_path):
    """TP ranks of one DP rank open the corpus themselves: an on-disk uint16 memmap and an in-memory
    int64 copy of the same ids give identical batches; other DP ranks and seeds give others."""
    TOKENS.tofile(tmp_path / "ids.bin")
    on_disk = np.memmap(tmp_path / "ids.bin", dtype=np.uint16, mode="r")

    def run(tokens: np.ndarray, seed: int = 0, dp_rank: int = 0) -> list[torch.Tensor]:
        it = TokenBatches(tokens, seq_len=8, micro_batch=4, seed=seed, dp_rank=dp_rank, dp_size=2)
        return [next(it)[0][0] for _ in range(5)]

    tp0, tp1 = run(on_disk), run(TOKENS.astype(np.int64).copy())
    assert all(torch.equal(a, b) for a, b in zip(tp0, tp1))
    assert not any(torch.equal(a, b) for a, b in zip(tp0, run(on_disk, dp_rank=1)))
    assert not any(torch.equal(a, b) for a, b in zip(tp0, run(on_disk, seed=1)))
    assert not torch.equal(tp0[0], tp0[1])


@pytest.mark.parametrize("micro_batch, accum, dp", [(4, 2, 1), (2, 2, 2), (1, 4, 2), (2, 1, 4)])
def test_every_split_of_a_global_batch_trains_on_the_same_windows(micro_batch, accum, dp):
    """A step's windows depend on (seed, step, global batch) only: micro-batch m of DP rank r is
    slice (m * dp + r) of the 8-window global batch, whatever the micro-batch and accumulation."""
    whole = TokenBatches(TOKENS, seq_len=8, micro_batch=8, seed=3)
    ranks = [TokenBatches(TOKENS, seq_len=8, micro_batch=micro_batch, seed=3, dp_rank=r, dp_size=dp, accum=accum)
             for r in range(dp)]
    assert all(r.global_batch == 8 for r in ranks)
    for step in range(4):
        (x, y), = whole.step_batches(step)
        per_rank = [r.step_batches(step) for r in ranks]
        assert all(len(p) == accum for p in per_rank)
        parts = [per_rank[r][m] for m in range(accum) for r in range(dp)]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
    with pytest.raises(ValueError, match=r"micro must lie in \[0, 2\), got 2"):
        TokenBatches(TOKENS, seq_len=8, micro_batch=2, seed=0, accum=2).batch(0, 2)


def test_resume_continues_the_same_stream():
    kw = dict(seq_len=8, micro_batch=2, seed=5, dp_rank=1, dp_size=2, accum=2)
    uninterrupted = TokenBatches(TOKENS, **kw)
    expected = [next(uninterrupted) for _ in range(7)]
    first = TokenBatches(TOKENS, **kw)
    for _ in range(4):
        next(first)
    state = first.state_dict()
    assert state == {"step": 4, "seed": 5, "global_batch": 8}
    resumed = TokenBatches(TOKENS, **kw)
    resumed.load_state_dict(state)
    for want in expected[4:]:
        got = next(resumed)
        assert all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))
    with pytest.raises(ValueError, match=r"train.seed=6 differs from the checkpoint.s train.seed=5"):
        TokenBatches(TOKENS, seq_len=8, micro_batch=2, seed=6).load_state_dict(state)


def test_eval_batches_spread_evenly_and_cut_like_a_step():
    held = TOKENS[1000:1500]  # id == position + 1000, so a window's first input is its start
    full = eval_batches(held, seq_len=8, micro_batch=4, num_batches=2)
    starts = [int(x[i, 0]) - 1000 for x, _ in full for i in range(4)]
    assert starts[0] == 0 and starts[-1] == len(held) - 9, "from the first window to the last"
    assert {b - a for a, b in zip(starts, starts[1:])} == {70, 71}, "8 windows evenly over 491 positions"
    for x, y in full:
        assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 8)) for row in x)
        assert torch.equal(y, x + 1)
    split = [eval_batches(held, seq_len=8, micro_batch=1, num_batches=2, dp_rank=r, dp_size=2, accum=2)
             for r in range(2)]
    for b in range(2):  # micro m of rank r is slice m * dp + r of each global batch
        parts = [split[r][b * 2 + m][0] for m in range(2) for r in range(2)]
        assert torch.equal(torch.cat(parts), full[b][0])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(seq_len=10_000), r"10000 tokens are fewer than seq_len \+ 1 = 10001"),
    (dict(dp_rank=2, dp_size=2), r"dp_rank=2 dp_size=2"),
    (dict(micro_batch=0), r"micro_batch=0"),
])
def test_batch_argument_errors(kwargs, pattern):
    args = dict(seq_len=8, micro_batch=2, seed=0) | kwargs
    with pytest.raises(ValueError, match=pattern):
        TokenBatches(TOKENS, **args)
    with pytest.raises(ValueError, match=r"accum=0"):
        eval_batches(TOKENS, seq_len=8, micro_batch=2, num_batches=1, accum=0)
