"""A text cache of several shards: the same stream as one file, encoded by several processes at
once (ranks and data.workers), resumable after a crash, damaged shards found and re-encoded."""
import numpy as np
import pytest

from seqpar.data import prepare_corpus, shards, text
from seqpar.data.corpus import open_corpus

V = 400


def _corpus(folder, n=40):
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = np.array("lorem ipsum dolor sit amet consectetur adipiscing elit sed do".split())
    for i in range(n):
        (folder / f"{i:03d}.txt").write_text(f"file {i}: " + " ".join(rng.choice(words, 60 + i)) + "\n")
    return folder


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(shards, "SHARD_BYTES", 3000)  # about 8 files a shard
    monkeypatch.setattr(text, "PIECE_BYTES", 1000)


def _reference(src, tmp_path):
    """The corpus as one tokens.bin (the default shard size), with its tokenizer."""
    one = prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "one", log=lambda _: None)
    return np.asarray(one.tokens), one.tokenizer


def test_shards_read_as_the_same_stream_as_one_file(tmp_path, monkeypatch):
    src = _corpus(tmp_path / "src")
    expected, tok = _reference(src, tmp_path)
    monkeypatch.setattr(shards, "SHARD_BYTES", 3000)
    monkeypatch.setattr(text, "PIECE_BYTES", 1000)
    logs = []
    corpus = prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "many", tokenizer=tok,
                            eot_id=tok.token_to_id("<|endoftext|>"), log=logs.append, workers=2)
    (folder,) = [p for p in (tmp_path / "many").iterdir() if p.is_dir()]
    names = sorted(p.name for p in folder.iterdir())
    n = sum(name.endswith(".bin") for name in names)
    assert n >= 4 and "tokens.bin" not in names and f"tokens-{n - 1:05d}.json" in names
    assert np.asarray(corpus.tokens).tolist() == expected.tolist()
    from seqpar.checkpoint import data_identity  # a checkpoint sees the same data either way
    assert data_identity(corpus.tokens, tok) == data_identity(expected.astype(corpus.tokens.dtype), tok)
    assert any("MB/s, ETA" in line and f"/{n} shards" in line for line in logs)
    assert any(f"({n} shards)" in line for line in logs)
    again = open_corpus(src, vocab_size=V, cache_dir=tmp_path / "many", tokenizer=tok,
                        eot_id=tok.token_to_id("<|endoftext|>"))
    assert np.asarray(again.tokens).tolist() == expected.tolist()


def test_a_crashed_build_keeps_its_finished_shards(tmp_path, monkeypatch, small_shards):
    src = _corpus(tmp_path / "src")
    real, calls = shards.encode_shard, []

    def dies_at_shard_3(job, k, tok):
        calls.append(k)
        if k == 3:
            raise KeyboardInterrupt("power cut")
        return real(job, k, tok)

    monkeypatch.setattr(shards, "encode_shard", dies_at_shard_3)
    with pytest.raises(KeyboardInterrupt):
        prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "cache", log=lambda _: None)
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    kept = {p.name: p.stat().st_mtime_ns for p in folder.glob("tokens-*.bin")}
    assert sorted(kept) == [f"tokens-{k:05d}.bin" for k in range(3)] and not (folder / "meta.json").exists()
    assert not list(folder.glob(".*.tmp"))  # the shard being written when it died left nothing
    with pytest.raises(FileNotFoundError, match="no prepared corpus"):
        open_corpus(src, vocab_size=V, cache_dir=tmp_path / "cache")  # nothing half-written is used
    monkeypatch.setattr(shards, "encode_shard", real)
    calls.clear()
    resumed = prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "cache", log=lambda _: None)
    assert {n: (folder / n).stat().st_mtime_ns for n in kept} == kept  # reused, not rewritten
    fresh = prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "fresh", log=lambda _: None)
    assert np.asarray(resumed.tokens).tolist() == np.asarray(fresh.tokens).tolist()


def test_a_damaged_shard_is_named_and_re_encoded(tmp_path, small_shards):
    src = _corpus(tmp_path / "src")
    expected = np.asarray(prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "cache", log=print).tokens)
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    shard = folder / "tokens-00002.bin"
    data = bytearray(shard.read_bytes())
    data[4] ^= 0x01  # same size, other bytes: only the SHA-256 tells
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="tokens-00002.bin does not match the SHA-256"):
        open_corpus(src, vocab_size=V, cache_dir=tmp_path / "cache")
    logs = []
    healed = prepare_corpus(src, vocab_size=V, cache_dir=tmp_path / "cache", log=logs.append)
    assert np.asarray(healed.tokens).tolist() == expected.tolist()
    assert any("rebuilding the corpus cache" in line for line in logs)
    assert not any("training byte-level BPE" in line for line in logs)


def _rank_prepares(rank, world, src, cache):
    from seqpar.data import shards as sh, text as tx

    sh.SHARD_BYTES, tx.PIECE_BYTES = 3000, 1000
    real, mine = sh.encode_shard, []

    def counted(job, k, tok):
        mine.append(k)
        return real(job, k, tok)

    sh.encode_shard = counted
    corpus = prepare_corpus(src, vocab_size=V, cache_dir=cache, log=lambda _: None)
    return np.asarray(corpus.tokens).tolist(), mine


def test_ranks_share_the_shards_and_each_is_encoded_once(tmp_path, spawn):
    src = _corpus(tmp_path / "src")
    (a, mine_a), (b, mine_b) = spawn(_rank_prepares, 2, str(src), str(tmp_path / "cache"))
    assert a == b
    (folder,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    n = len(list(folder.glob("tokens-*.bin")))
    assert sorted(mine_a + mine_b) == list(range(n))  # every shard once, by one of the two ranks


def test_dataset_records_are_sharded_and_read_by_helper_processes(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    import json

    rows = [{"text": f"record {i} " + "lorem ipsum " * (i % 7 + 1)} for i in range(2500)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    one = prepare_corpus(tmp_path / "d.jsonl", vocab_size=V, cache_dir=tmp_path / "one", log=lambda _: None)
    monkeypatch.setattr(shards, "SHARD_BYTES", 20_000)  # about one 1000-record piece a shard
    many = prepare_corpus(tmp_path / "d.jsonl", vocab_size=V, cache_dir=tmp_path / "many", log=lambda _: None,
                          tokenizer=one.tokenizer, eot_id=one.eot_id, workers=2)
    (folder,) = (tmp_path / "many").glob("corpus-*/")
    assert len(list(folder.glob("tokens-*.bin"))) == 3
    assert np.asarray(many.tokens).tolist() == np.asarray(one.tokens).tolist()
