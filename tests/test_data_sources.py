"""Token sources read in place (a folder of shards, a Megatron indexed dataset) and Hugging Face
``datasets`` files as text, each with its bad-input errors naming the file and the value."""
import json
import struct

import numpy as np
import pytest

from seqpar.data import TokenBatches, prepare_corpus
from seqpar.data.corpus import MissingSource, open_corpus, source_kind
from seqpar.data.errors import DataError

V = 1000
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_indexed(prefix, documents, dtype=np.uint16):
    """A Megatron indexed dataset as its documentation describes it. ``documents``: a list of
    documents, each a list of sequences (lists of ids)."""
    seqs = [np.asarray(s, dtype=dtype) for doc in documents for s in doc]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    lengths = np.array([len(s) for s in seqs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) * np.dtype(dtype).itemsize)[:-1]])
    doc_index = np.concatenate([[0], np.cumsum([len(doc) for doc in documents])]).astype(np.int64)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_index)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_index.tobytes())


DOCS = [[[5, 6, 7], [8, 9]], [[10, 11]], [[12], [13, 14, 15]]]  # three documents, five sequences


def test_megatron_indexed_dataset_is_read_in_place_with_document_boundaries(tmp_path):
    for dtype in (np.uint16, np.int32):
        prefix = tmp_path / f"corpus.{np.dtype(dtype).name}_text_document"  # a prefix with a dot in it
        write_indexed(prefix, DOCS, dtype)
        for name in (prefix, f"{prefix}.bin", f"{prefix}.idx"):
            assert source_kind(name) == "indexed"
            corpus = prepare_corpus(name, vocab_size=V, cache_dir=tmp_path / "cache", eot_id=3, log=print)
            assert np.asarray(corpus.tokens).tolist() == [5, 6, 7, 8, 9, 3, 10, 11, 3, 12, 13, 14, 15]
            assert corpus.tokens.doc_starts().tolist() == [0, 6, 9] and corpus.eot_id == 3
        assert not (tmp_path / "cache").exists()  # nothing converted or cached
    # documents that already end with the end-of-text id get no second one; it is inferred
    write_indexed(tmp_path / "eod", [[[5, 6, 2]], [[7, 2]], [[8, 9, 2]]])
    corpus = open_corpus(tmp_path / "eod", vocab_size=V)
    assert np.asarray(corpus.tokens).tolist() == [5, 6, 2, 7, 2, 8, 9, 2] and corpus.eot_id == 2
    # training windows over the stream are the windows of the joined ids
    joined = np.asarray(corpus.tokens)
    a = TokenBatches(corpus.tokens, seq_len=3, micro_batch=2, seed=0).batch(4)
    b = TokenBatches(joined, seq_len=3, micro_batch=2, seed=0).batch(4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_megatron_core_builder_output_reads_the_same(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import torch

    builder = indexed.IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    for doc in DOCS:
        for seq in doc:
            builder.add_item(torch.tensor(seq))
        builder.end_document()
    builder.finalize(str(tmp_path / "m.idx"))
    write_indexed(tmp_path / "ours", DOCS)
    assert (tmp_path / "m.idx").read_bytes()[:9] == (tmp_path / "ours.idx").read_bytes()[:9]
    theirs = open_corpus(tmp_path / "m", vocab_size=V, eot_id=3).tokens
    assert np.asarray(theirs).tolist() == np.asarray(open_corpus(tmp_path / "ours", vocab_size=V, eot_id=3).tokens
                                                     ).tolist()


def test_indexed_dataset_errors_name_the_file(tmp_path):
    write_indexed(tmp_path / "d", DOCS)
    with pytest.raises(DataError, match="no end-of-text id known to join its 3 documents; set data.eot_id"):
        open_corpus(tmp_path / "d", vocab_size=V)
    with pytest.raises(DataError, match=r"d.idx.*outside|id 12 .*outside the vocabulary \[0, 12\)"):
        open_corpus(tmp_path / "d", vocab_size=12, eot_id=3)
    raw = (tmp_path / "d.bin").read_bytes()
    (tmp_path / "d.bin").write_bytes(raw[:-2])  # one id short
    with pytest.raises(DataError, match=r"d.idx' does not match its .bin: the index describes 22 bytes .* has 20"):
        open_corpus(tmp_path / "d", vocab_size=V, eot_id=3)
    idx = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX" + idx[8:])
    with pytest.raises(DataError, match="d.idx' is not a Megatron index"):
        open_corpus(tmp_path / "d", vocab_size=V, eot_id=3)
    (tmp_path / "d.idx").write_bytes(idx[:-8])
    with pytest.raises(DataError, match=r"d.idx' has \d+ bytes; 5 sequences and 4 documents need"):
        open_corpus(tmp_path / "d", vocab_size=V, eot_id=3)
    (tmp_path / "d.idx").write_bytes(idx)
    (tmp_path / "d.bin").unlink()
    with pytest.raises(DataError, match=r"d.bin' is missing"):
        open_corpus(tmp_path / "d", vocab_size=V, eot_id=3)
    (tmp_path / "folder").mkdir()
    write_indexed(tmp_path / "folder" / "a", DOCS)
    with pytest.raises(DataError, match="folder of Megatron indexed datasets"):
        open_corpus(tmp_path / "folder", vocab_size=V)


def test_a_folder_of_token_shards_is_one_stream(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, V, n) for n in (50, 7, 30)]
    np.save(shards / "000.npy", parts[0].astype(np.uint16))
    parts[1].astype(np.uint16).tofile(shards / "001.bin")
    np.save(shards / "002.npy", parts[2].astype(np.int32))
    (shards / "README.md").write_text("# my shards")  # documentation beside them: skipped, not read as text
    (shards / "LICENSE").write_text("MIT")
    assert source_kind(shards) == "shards"
    (shards / "notes.txt").write_text("not a shard")  # any other text beside them: refused, naming both
    with pytest.raises(DataError, match=r"mixes token shards \(3: 000.npy, 001.bin, 002.npy\) with text files "
                                        r"\(1: notes.txt\); a folder holds one kind of data"):
        source_kind(shards)
    (shards / "notes.txt").unlink()
    logs = []
    corpus = prepare_corpus(shards, vocab_size=V, cache_dir=tmp_path / "cache", log=logs.append)
    assert logs == [f"data: {str(shards)!r}: skipping README.md beside the data files"]
    assert np.asarray(corpus.tokens).tolist() == np.concatenate(parts).tolist() and len(corpus.tokens) == 87
    train, held = corpus.split(0.1)
    assert np.asarray(held).tolist() == np.concatenate(parts)[-8:].tolist() and len(train) == 79
    assert corpus.tokenizer is None


def test_shard_errors_name_the_shard_and_the_value(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    np.save(shards / "a.npy", np.arange(10, dtype=np.uint16))
    np.save(shards / "b.npy", np.array([1, 2, V + 5], dtype=np.uint16))
    with pytest.raises(DataError, match=rf"b.npy': id {V + 5} at position 2 is outside the vocabulary"):
        open_corpus(shards, vocab_size=V)
    (shards / "b.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(DataError, match="b.npy' is unreadable"):
        open_corpus(shards, vocab_size=V)
    (shards / "b.npy").unlink()
    (shards / "c.bin").write_bytes(b"\x01\x00\x02")  # 1.5 uint16 ids
    with pytest.raises(DataError, match="c.bin': 3 bytes is not a whole number of uint16 ids"):
        open_corpus(shards, vocab_size=V)
    (shards / "c.bin").write_bytes(b"")
    with pytest.raises(DataError, match="c.bin' must hold a non-empty"):
        open_corpus(shards, vocab_size=V)
    with pytest.raises(MissingSource, match="nope.npy' does not exist"):
        open_corpus(tmp_path / "nope.npy", vocab_size=V)
    with pytest.raises(MissingSource, match="nothing-here' does not exist"):
        prepare_corpus(tmp_path / "nothing-here", vocab_size=V, cache_dir=tmp_path / "cache", log=print)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty' holds no non-empty text files"):
        prepare_corpus(tmp_path / "empty", vocab_size=V, cache_dir=tmp_path / "cache", log=print)


def _records(tmp_path):
    rows = [{"id": i, "text": f"record {i} says " + "hello world " * (i + 1)} for i in range(6)]
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_datasets_files_are_text_sources(tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _records(tmp_path)
    pq.write_table(pa.table({"body": [r["text"] for r in rows]}), tmp_path / "t.parquet")
    from tokenizers import Tokenizer
    tok = None
    for source, field in ((tmp_path / "jsonl", "text"), (tmp_path / "t.parquet", "body")):
        assert source_kind(source) == "records"
        corpus = prepare_corpus(source, vocab_size=400, cache_dir=tmp_path / "cache", text_field=field, log=print,
                                tokenizer=tok, eot_id=None if tok is None else tok.token_to_id("<|endoftext|>"))
        tok = tok or Tokenizer.from_str(corpus.tokenizer.to_str())
        eot = corpus.eot_id
        text = corpus.decode(np.asarray(corpus.tokens))
        assert text == "<|endoftext|>".join(r["text"] for r in rows) and eot is not None
    # the records become one cache entry per tokenizer and field, reused on the next open
    again = open_corpus(tmp_path / "t.parquet", vocab_size=400, cache_dir=tmp_path / "cache", text_field="body",
                        tokenizer=tok, eot_id=tok.token_to_id("<|endoftext|>"))
    assert np.array_equal(np.asarray(again.tokens), np.asarray(corpus.tokens))


def _decoded(source, tmp_path, tok=None, **kw):
    """The text ``prepare_corpus`` reads from ``source`` (documents joined by end-of-text) and its tokenizer."""
    from tokenizers import Tokenizer
    corpus = prepare_corpus(source, vocab_size=400, cache_dir=tmp_path / "cache", tokenizer=tok,
                            eot_id=None if tok is None else tok.token_to_id("<|endoftext|>"), **kw)
    return corpus.decode(np.asarray(corpus.tokens)), tok or Tokenizer.from_str(corpus.tokenizer.to_str())


def test_an_arrow_file_is_a_text_source(tmp_path):
    pytest.importorskip("datasets")
    import pyarrow as pa

    rows = _records(tmp_path)
    table = pa.table({"text": [r["text"] for r in rows], "n": list(range(len(rows)))})
    with pa.OSFile(str(tmp_path / "t.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)  # the Arrow IPC file format (.arrow, also what Feather v2 writes)
    assert source_kind(tmp_path / "t.arrow") == "records"
    text, _ = _decoded(tmp_path / "t.arrow", tmp_path, log=print)
    assert text == "<|endoftext|>".join(r["text"] for r in rows)


def test_datasets_folders_skip_their_documentation_and_refuse_other_text(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = _records(tmp_path)
    want = "<|endoftext|>".join(r["text"] for r in rows)
    (tmp_path / "jsonl" / "README.md").write_text("# dataset card\n" + "about this data " * 200)
    (tmp_path / "jsonl" / "LICENSE.txt").write_text("Apache-2.0")
    assert source_kind(tmp_path / "jsonl") == "records"
    logs = []
    text, tok = _decoded(tmp_path / "jsonl", tmp_path, log=logs.append)
    assert text == want and "dataset card" not in text
    assert logs[0] == f"data: {str(tmp_path / 'jsonl')!r}: skipping LICENSE.txt, README.md beside the data files"
    run = tmp_path / "jsonl" / "runs"  # a run's own output inside its source: never part of it
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"text": "a loss line"}\n')
    (run / "config.yaml").write_text("model: {}\n")
    assert source_kind(tmp_path / "jsonl", exclude=[run]) == "records"
    assert _decoded(tmp_path / "jsonl", tmp_path, tok, log=print, exclude=[run])[0] == want
    # a Dataset.save_to_disk folder (state.json, dataset_info.json, *.arrow): its records, in order
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved), num_shards=2)
    assert {p.name for p in saved.iterdir()} >= {"state.json", "dataset_info.json", "data-00001-of-00002.arrow"}
    assert source_kind(saved) == "records"
    assert _decoded(saved, tmp_path, tok, log=print)[0] == want
    (tmp_path / "jsonl" / "notes.txt").write_text("is this data?")
    with pytest.raises(DataError, match=r"jsonl' mixes datasets files \(1: part.jsonl\) with text files \(1: "
                                        r"notes.txt\); a folder holds one kind of data"):
        prepare_corpus(tmp_path / "jsonl", vocab_size=400, cache_dir=tmp_path / "cache", log=print, exclude=[run])
    both = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
                         ).save_to_disk(str(both))
    with pytest.raises(DataError, match=r"is a DatasetDict saved with save_to_disk; name one of its splits "
                                        r"\['test', 'train'\]"):
        source_kind(both)


def test_datasets_errors_name_the_file_and_the_field(tmp_path):
    pytest.importorskip("datasets")
    _records(tmp_path)
    with pytest.raises(DataError, match=r"part.jsonl' has no column data.text_field='content' \(columns: \['id', "
                                        r"'text'\]\)"):
        prepare_corpus(tmp_path / "jsonl", vocab_size=400, cache_dir=tmp_path / "cache", text_field="content",
                       log=print)
    (tmp_path / "ints.jsonl").write_text('{"text": 5}\n{"text": "x"}\n')
    with pytest.raises(DataError, match="record 0 has data.text_field='text' of type int, not a string"):
        prepare_corpus(tmp_path / "ints.jsonl", vocab_size=400, cache_dir=tmp_path / "cache", log=print)
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{not json\n')
    with pytest.raises(DataError, match="broken.jsonl' is unreadable"):
        prepare_corpus(tmp_path / "broken.jsonl", vocab_size=400, cache_dir=tmp_path / "cache", log=print)
    assert not list((tmp_path / "cache").glob("corpus-*/meta.json"))  # nothing half-written is usable
