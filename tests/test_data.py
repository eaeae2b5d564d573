"""Data pipeline: tokenizer/token cache, held-out split, seeded DP-sliced batches, resume."""
from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from seqpar.train.data import (EOT, Corpus, TokenBatches, default_cache_dir, eval_batches, list_documents,
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
    assert logs == [] and {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
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
    with pytest.raises(ValueError, match=r"ids\.npy' holds ids in \[0, 999\], outside vocab_size 500"):
        open_corpus(tmp_path / "ids.npy", vocab_size=500)
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
    x, y = next(TokenBatches(TOKENS, seq_len=16, micro_batch=3, seed=1))
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)


def test_deterministic_tp_identical_dp_different():
    def run(seed: int, dp_rank: int = 0) -> list[torch.Tensor]:
        it = TokenBatches(TOKENS, seq_len=8, micro_batch=4, seed=seed, dp_rank=dp_rank, dp_size=2)
        return [next(it)[0] for _ in range(5)]

    tp0, tp1 = run(0), run(0)  # TP ranks of one DP rank build the loader identically
    assert all(torch.equal(a, b) for a, b in zip(tp0, tp1))
    assert not any(torch.equal(a, b) for a, b in zip(tp0, run(0, dp_rank=1)))
    assert not any(torch.equal(a, b) for a, b in zip(tp0, run(1)))
    assert not torch.equal(tp0[0], tp0[1])


def test_dp_slices_union_equals_single_rank_double_batch():
    single = TokenBatches(TOKENS, seq_len=8, micro_batch=6, seed=3)
    ranks = [TokenBatches(TOKENS, seq_len=8, micro_batch=3, seed=3, dp_rank=r, dp_size=2) for r in range(2)]
    for _ in range(4):
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)


def test_resume_continues_the_same_stream():
    uninterrupted = TokenBatches(TOKENS, seq_len=8, micro_batch=2, seed=5, dp_rank=1, dp_size=2)
    expected = [next(uninterrupted) for _ in range(7)]
    first = TokenBatches(TOKENS, seq_len=8, micro_batch=2, seed=5, dp_rank=1, dp_size=2)
    for _ in range(4):
        next(first)
    state = first.state_dict()
    assert state == {"step": 4, "seed": 5}
    resumed = TokenBatches(TOKENS, seq_len=8, micro_batch=2, seed=5, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    for want in expected[4:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="checkpoint seed 5 differs from seed 6"):
        TokenBatches(TOKENS, seq_len=8, micro_batch=2, seed=6).load_state_dict(state)


def test_eval_batches_fixed_and_dp_sliced():
    held = TOKENS[:500]
    full = eval_batches(held, seq_len=8, micro_batch=4, num_batches=2)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full, eval_batches(held, seq_len=8, micro_batch=4,
                                                                          num_batches=2)))
    halves = [eval_batches(held, seq_len=8, micro_batch=2, num_batches=2, dp_rank=r, dp_size=2) for r in range(2)]
    for b in range(2):
        assert torch.equal(torch.cat([halves[0][b][0], halves[1][b][0]]), full[b][0])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(seq_len=10_000), r"10000 tokens are fewer than seq_len \+ 1 = 10001"),
    (dict(dp_rank=2, dp_size=2), r"dp_rank=2 dp_size=2"),
    (dict(micro_batch=0), r"micro_batch=0"),
])
def test_batch_argument_errors(kwargs, pattern):
    args = dict(seq_len=8, micro_batch=2, seed=0) | kwargs
    with pytest.raises(ValueError, match=pattern):
        TokenBatches(TOKENS, **args)
