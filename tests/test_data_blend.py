"""Blends (``data.sources``): the mix drawn follows the weights, is the same for every dp size,
micro-batch split and restart, each window comes from one source, each source keeps its own
held-out tail, and the sources must share a tokenizer."""
import numpy as np
import pytest
import torch

from seqpar.config import load_run_config
from seqpar.data import load_corpus
from seqpar.data.blend import BlendBatches, mix_sources
from seqpar.data.errors import DataError
from seqpar.data.feed import run_batches
from seqpar.distributed.mesh import ParallelMesh
from seqpar.train import Trainer

S = 8


def _parts(lengths=(4000, 3000, 2000)):
    """Source k holds ids in [100 k, 100 k + 100), so a window tells its source."""
    rng = np.random.default_rng(0)
    return [(100 * k + rng.integers(0, 100, n)).astype(np.uint16) for k, n in enumerate(lengths)]


def _blend(**kw):
    shape = dict(seq_len=S, micro_batch=4, seed=7) | kw
    return BlendBatches(_parts(), [5.0, 3.0, 2.0], ["a", "b", "c"], **shape)


def test_the_mix_drawn_follows_the_weights_and_is_reported():
    b = _blend(micro_batch=16)  # 16 sequences a step: 625 steps are 10k sequences
    counts = np.zeros(3, np.int64)
    for step in range(625):
        src, starts = b.picks(step)
        counts += np.bincount(src, minlength=3)
        assert np.all(starts >= 0) and np.all(starts + S < b.lengths[src])
    assert counts.sum() == 10_000
    assert np.abs(counts / 10_000 - [0.5, 0.3, 0.2]).max() < 0.01
    assert np.array_equal(b.drawn(625), counts)
    line = b.mix_line(625)
    assert line.startswith("data: blend over 625 steps x 16 sequences: a 50.0% (weight 50.0%)") and "c 20.0%" in line
    # any window of consecutive sequences is close to the weights too (not only the whole run)
    window = np.bincount(mix_sources(7, 123_456_789_000, 1000, b.cum), minlength=3)
    assert np.abs(window / 1000 - [0.5, 0.3, 0.2]).max() < 0.01


def _global(step, dp, micro_batch, accum):
    """The step's global batch assembled from every rank's micro-batches, in global order."""
    rows = {}
    for r in range(dp):
        b = _blend(micro_batch=micro_batch, dp_rank=r, dp_size=dp, accum=accum)
        for m in range(accum):
            x, _ = b.batch(step, m)
            for i in range(micro_batch):
                rows[(m * dp + r) * micro_batch + i] = x[i]
    return torch.stack([rows[i] for i in sorted(rows)])


def test_each_window_comes_from_its_source_and_the_split_does_not_matter():
    b = _blend(micro_batch=8)
    for step in (0, 5):
        src, _ = b.picks(step)
        x, y = b.batch(step)
        assert torch.equal(x // 100, torch.as_tensor(src)[:, None].expand(-1, S))
        assert torch.equal(x[:, 1:], y[:, :-1])
        reference = _global(step, 1, 8, 1)
        assert torch.equal(reference, x)
        for dp, mb, accum in ((2, 2, 2), (4, 1, 2), (8, 1, 1)):
            assert torch.equal(_global(step, dp, mb, accum), reference)


def test_resume_mid_run_continues_the_same_stream():
    first = _blend()
    seen = [next(first) for _ in range(6)]
    again = _blend()
    again.load_state_dict(_blend().state_dict() | {"step": 3})
    for step in range(3, 6):
        got = next(again)
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, seen[step]))
    with pytest.raises(DataError, match=r"'c' has 5 tokens, fewer than seq_len \+ 1 = 9"):
        BlendBatches(_parts((100, 100, 5)), [1, 1, 1], ["a", "b", "c"], seq_len=S, micro_batch=2, seed=0)


def _texts(folder, word, n=4):
    folder.mkdir(parents=True)
    for i in range(n):
        (folder / f"{i}.txt").write_text(f"{word} {i} " * 200)
    return folder


def test_a_run_blends_text_and_tokens_with_held_out_tails_per_source(tmp_path):
    from tokenizers.implementations import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["alpha beta gamma 0123456789 " * 50], vocab_size=300, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save(str(tmp_path / "tok.json"))
    a, b = _texts(tmp_path / "a", "alpha"), _texts(tmp_path / "b", "beta")
    np.save(tmp_path / "ids.npy", np.random.default_rng(1).integers(0, 290, 5000).astype(np.uint16))
    blend = (f"data.sources=[{{source: {a}, weight: 3}}, {{source: {b}, weight: 1}}, "
             f"{{source: {tmp_path / 'ids.npy'}, weight: 1}}]")
    base = [blend, f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=320", f"model.seq_len={S}",
            "model.layers=1", "model.hidden=16", "model.heads=2", "train.micro_batch=2", "train.steps=2",
            "train.eval_interval=1", "train.eval_batches=1", f"out_dir={tmp_path / 'run'}",
            f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.interval=0"]
    with pytest.raises(DataError, match=r"need one shared tokenizer .* set data.tokenizer"):
        load_corpus(load_run_config(None, base), print)
    cfg = load_run_config(None, base + [f"data.tokenizer={tmp_path / 'tok.json'}"])
    corpus = load_corpus(cfg, print)
    assert corpus.weights == (0.6, 0.2, 0.2) and len(corpus.tokens) == sum(len(p.tokens) for p in corpus.parts)
    logs = []
    batches, evals = run_batches(cfg, corpus, 0, 1, 1, logs.append)
    assert len(evals) == 3 and logs[0].startswith("data: blend over 2 steps x 2 sequences: ")
    assert f"{a} 75.0% (weight 60.0%)" in logs[0]  # 3 of the 4 sequences the run draws
    for part, (x, _) in zip(corpus.parts, evals):  # each source's held-out batch is cut from its own tail
        tail = np.asarray(part.split(cfg.data.eval_fraction)[1]).tolist()
        assert x[0].tolist() == tail[:S]
    trainer = Trainer(cfg, mesh=ParallelMesh.single())
    try:
        result = trainer.fit()
    finally:
        trainer.close()
    assert len(result["losses"]) == 2 and np.isfinite(result["losses"]).all()
    # a token source made with another tokenizer cannot join
    bpe.save(str(tmp_path / "tokenizer.json"))  # beside ids.npy, read for it when data.tokenizer is unset
    other = ByteLevelBPETokenizer()
    other.train_from_iterator(["zeta eta theta " * 50], vocab_size=280, min_frequency=1,
                              special_tokens=["<|endoftext|>"], show_progress=False)
    other.save(str(tmp_path / "tokenizer.json"))
    mixed = load_run_config(None, [f"data.sources=[{{source: {a}}}, {{source: {tmp_path / 'ids.npy'}}}]"] + base[1:]
                            + [f"checkpoint.dir={tmp_path / 'fresh'}"])
    with pytest.raises(DataError, match="were made with different tokenizers"):
        load_corpus(mixed, print)


# ---- a blended run through the Trainer: resume exact, changed weights refused ------------------

def _blend_trainer(tmp, ckpt: str, weights=(3, 1), steps=4, **changes):
    a, b = tmp / "a.npy", tmp / "b.npy"
    overrides = {"data.sources": f"[{{source: {a}, weight: {weights[0]}}}, {{source: {b}, weight: {weights[1]}}}]",
                 "model.vocab_size": 200, "model.seq_len": S, "model.layers": 1, "model.hidden": 16,
                 "model.heads": 2, "train.micro_batch": 2, "train.global_batch": 4, "train.steps": steps,
                 "train.eval_interval": 0, "train.log_interval": 1, "train.seed": 5, "checkpoint.dir": tmp / ckpt,
                 "checkpoint.interval": 2, "checkpoint.resume": "auto", "out_dir": tmp / f"{ckpt}-out", **changes}
    return Trainer(load_run_config(None, [f"{k}={v}" for k, v in overrides.items()]), mesh=ParallelMesh.single())


def _fit(trainer) -> list[float]:
    try:
        return trainer.fit()["losses"]
    finally:
        trainer.close()


def test_a_blended_run_resumes_exactly_and_refuses_changed_weights(tmp_path):
    from seqpar.checkpoint.errors import CheckpointMismatch

    for name, part in zip(("a.npy", "b.npy"), _parts((3000, 2000))):
        np.save(tmp_path / name, part)
    whole = _fit(_blend_trainer(tmp_path, "whole"))
    assert len(whole) == 4
    assert len(_fit(_blend_trainer(tmp_path, "cut", steps=2))) == 2  # stops after its step-2 checkpoint
    resumed = _fit(_blend_trainer(tmp_path, "cut"))
    assert resumed == whole[2:], (resumed, whole)  # the same batches, weights, dropout masks
    swapped = _blend_trainer(tmp_path, "cut", weights=(1, 3))
    try:
        with pytest.raises(CheckpointMismatch) as info:
            swapped.checkpoints.resume()
    finally:
        swapped.close()
    msg = str(info.value)
    assert "\n" not in msg and "other data than data.sources gives" in msg, msg
    assert f"the blend weights ({tmp_path / 'a.npy'} 0.75, {tmp_path / 'b.npy'} 0.25 -> {tmp_path / 'a.npy'} 0.25, " \
           f"{tmp_path / 'b.npy'} 0.75)" in msg, msg
    same = _blend_trainer(tmp_path, "cut", weights=(6, 2))  # the same shares: the same blend
    try:
        assert (same.checkpoints.resume() or 0) == 4
    finally:
        same.close()
    allowed = _blend_trainer(tmp_path, "cut", weights=(1, 3), **{"checkpoint.allow_data_change": True})
    try:
        assert (allowed.checkpoints.resume() or 0) == 4
    finally:
        allowed.close()
