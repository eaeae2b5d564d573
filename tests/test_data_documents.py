"""Documents: an end-of-text id between documents, sequences packed across them, masking inside
a document refused as not supported yet; bad data refused on every rank before training."""
import numpy as np
import pytest

from seqpar.config import ConfigError, load_run_config
from seqpar.data import prepare_corpus


def test_text_documents_are_joined_by_one_end_of_text_id(tmp_path):
    for i in range(5):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"{i}.txt").write_text(f"document number {i} " * 30)
    corpus = prepare_corpus(tmp_path / "src", vocab_size=400, cache_dir=tmp_path / "cache", log=lambda _: None)
    ids = np.asarray(corpus.tokens)
    assert int((ids == corpus.eot_id).sum()) == 4 and ids[0] != corpus.eot_id and ids[-1] != corpus.eot_id
    pieces = corpus.decode(ids).split("<|endoftext|>")
    assert pieces == [(tmp_path / "src" / f"{i}.txt").read_text() for i in range(5)]


def test_attention_inside_documents_is_refused_as_not_supported_yet():
    with pytest.raises(ConfigError, match="data.document_masking=true .* is not supported yet"):
        load_run_config(None, ["data.document_masking=true"])
    assert load_run_config(None, []).data.document_masking is False


def _bad_source(rank, world, source, tmp):
    from seqpar.data.errors import DataError
    from seqpar.train import Trainer

    cfg = load_run_config(None, [f"data.source={source}", f"out_dir={tmp}/run", f"checkpoint.dir={tmp}/ck",
                                 f"data.cache_dir={tmp}/cache", "model.layers=1", "model.hidden=16", "model.heads=2",
                                 "model.seq_len=8", "train.micro_batch=1"])
    try:
        Trainer(cfg).close()
    except DataError as e:
        return str(e)
    return None


def test_bad_data_fails_on_every_rank_before_training(tmp_path, spawn):
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY not an array")
    messages = spawn(_bad_source, 2, str(tmp_path / "bad.npy"), str(tmp_path))
    assert messages[0] == messages[1] and "bad.npy' is unreadable" in messages[0]


def test_a_text_source_cut_by_max_bytes_says_so(tmp_path):
    (tmp_path / "src").mkdir()
    for i in range(3):
        (tmp_path / "src" / f"{i}.txt").write_text("words and more words " * 50)
    logs = []
    prepare_corpus(tmp_path / "src", vocab_size=400, cache_dir=tmp_path / "cache", log=logs.append, max_bytes=1500)
    assert any("reading only the first 1,500 bytes" in line and "data.max_bytes" in line for line in logs)
    logs.clear()
    prepare_corpus(tmp_path / "src", vocab_size=400, cache_dir=tmp_path / "cache", log=logs.append)
    assert not any("reading only" in line for line in logs)
