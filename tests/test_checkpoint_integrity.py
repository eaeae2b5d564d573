"""Checkpoints are verified, refuse another model or data, and fail a full disk in one line.

1. Every file's CRC-32 is in ``complete.json`` and checked on load: a damaged file is named in one
   line (an explicit path), or skipped for the previous checkpoint with one line in the run's log
   (resume), never a Python warning (which ``PYTHONWARNINGS=ignore`` would hide).
2. A resume refuses another model (each changed key listed with its saved and new value), saved
   tensors the model does not have, and other data unless ``checkpoint.allow_data_change``.
3. A write that fails (ENOSPC, torch's short write) names the file and "no space left on device";
   the newest complete checkpoint is what a resume picks, whatever ``latest`` says.
"""
import dataclasses
import errno
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from seqpar.checkpoint import (CheckpointCorrupt, CheckpointMismatch, CheckpointWriteError, files, latest_checkpoint,
                               load_checkpoint, load_model_only, resume_latest, save_checkpoint)
from seqpar.checkpoint.compat import (MODEL_KEYS, RUNTIME_KEYS, check_compatible, data_changes, data_identity,
                                     model_changes)
from seqpar.config import RunConfig, dump, load_run_config
from seqpar.model import GPT, GPTConfig
from seqpar.train.optim import build_optimizer

SMALL = dict(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2)


def _model(**changes) -> tuple[GPT, torch.optim.Optimizer]:
    model = GPT(GPTConfig(**{**SMALL, **changes}), seed=0)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    opt.step()
    return model, opt


def _run(**model_changes) -> RunConfig:
    cfg = RunConfig(model=GPTConfig(**{**SMALL, **model_changes}))
    cfg.checkpoint.dir = "unused"
    return cfg


def _save(root: Path, step: int, model_opt, cfg: RunConfig | None = None, extra: dict | None = None,
          attachments=None) -> Path:
    model, opt = model_opt
    return save_checkpoint(root, step, model, opt, {"tp": 1, **(extra or {})}, dump(cfg or _run()), model.rng,
                           keep=0, attachments=attachments)


@pytest.fixture(scope="module")
def tiny():
    return _model()


def _flip(path: Path, offset: int | None = None, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of ``path`` (or at ``offset``); the size stays."""
    data = bytearray(path.read_bytes())
    at = max(len(data) // 2 - n // 2, 0) if offset is None else offset
    for i in range(at, min(at + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _tokenizer_file(tmp: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", "def", "x", "return"])}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "tokenizer.json"))
    return tmp / "tokenizer.json"


# ---- 1. checksums --------------------------------------------------------------------------------

SMALL_FILES = {".metadata": 100, "rng_rank0.pt": None, "tokenizer.json": None, "extra.json": None}


@pytest.mark.parametrize("name", ["__0_0.distcp", *SMALL_FILES])
def test_a_damaged_file_is_named_and_resume_falls_back_once(tmp_path, tiny, name):
    root = tmp_path / "ckpt"
    tok = _tokenizer_file(tmp_path)
    good = _save(root, 10, tiny, attachments={"tokenizer.json": tok})
    bad = _save(root, 20, tiny, attachments={"tokenizer.json": tok})
    _flip(bad / name, SMALL_FILES.get(name))
    model, opt = _model()
    with pytest.raises(CheckpointCorrupt, match=rf"{bad / name}.*checksum") as raised:
        load_checkpoint(bad, model, opt, model.rng)
    assert "\n" not in str(raised.value)
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the fallback is a line of the run's log, never a warning
        folder, extra = resume_latest(root, model, opt, model.rng, config=_run(), log=said.append)
    assert folder == good and extra["step"] == 10
    named = [line for line in said if str(bad / name) in line]
    assert len(named) == 1 and str(good) in named[0], said


@pytest.mark.parametrize("name", list(SMALL_FILES))
def test_unverified_damaged_small_files_fail_in_one_line(tmp_path, tiny, name):
    """With checkpoint.verify off a damaged file is still one CheckpointError naming it: no
    UnicodeDecodeError, no advice to unpickle with weights_only=False."""
    root = tmp_path / "ckpt"
    tok = _tokenizer_file(tmp_path)
    good = _save(root, 10, tiny, attachments={"tokenizer.json": tok})
    bad = _save(root, 20, tiny, attachments={"tokenizer.json": tok})
    _flip(bad / name, 0 if name == "rng_rank0.pt" else SMALL_FILES[name])  # its header: the middle is state bytes
    cfg = _run()
    cfg.checkpoint.verify = False
    model, opt = _model()
    with pytest.raises(CheckpointCorrupt) as raised:
        load_checkpoint(bad, model, opt, model.rng, config=cfg, data=None, verify=False)
    message = str(raised.value)
    assert name in message and "\n" not in message and "weights_only" not in message, message
    said: list[str] = []
    assert resume_latest(root, model, opt, model.rng, config=cfg, log=said.append)[0] == good
    assert len(said) == 1 and name in said[0] and good.name in said[0], said


def test_load_model_only_verifies_too(tmp_path, tiny):
    bad = _save(tmp_path / "ckpt", 3, tiny)
    _flip(bad / "__0_0.distcp")
    with pytest.raises(CheckpointCorrupt, match="__0_0.distcp"):
        load_model_only(bad, _model()[0])
    load_model_only(bad, _model()[0], verify=False)  # the damage sits in bytes no check reads: loads


def test_every_checkpoint_damaged_is_an_error_not_a_fresh_start(tmp_path, tiny):
    root = tmp_path / "ckpt"
    _flip(_save(root, 10, tiny) / "__0_0.distcp")
    model, opt = _model()
    with pytest.raises(CheckpointCorrupt, match="no checkpoint under .* is intact"):
        resume_latest(root, model, opt, model.rng, config=_run(), log=lambda line: None)


def test_checkpoint_verify_is_a_config_key():
    assert load_run_config(None, ["checkpoint.verify=false"]).checkpoint.verify is False
    assert load_run_config(None).checkpoint.verify is True
    assert load_run_config(None, ["checkpoint.allow_data_change=true"]).checkpoint.allow_data_change is True


# ---- 2. the same model and data ---------------------------------------------------------------------

CHANGES = {"layers": 1, "bias": False, "norm": "rmsnorm", "heads": 4, "activation": "gelu_tanh",
           "layernorm_eps": 1e-6, "hidden": 32, "tie_embeddings": False, "seq_len": 16}


@pytest.mark.parametrize("key", sorted(CHANGES))
def test_a_resume_refuses_another_model_naming_each_key(tmp_path, tiny, key):
    folder = _save(tmp_path / "ckpt", 20, tiny)
    cfg = _run(**{key: CHANGES[key]})
    model, opt = _model(**{key: CHANGES[key]})
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(CheckpointMismatch, match=rf"model\.{key}: {SMALL_or_default(key)!r} -> {CHANGES[key]!r}"):
        load_checkpoint(folder, model, opt, model.rng, config=cfg)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "refused, yet loaded"


def SMALL_or_default(key):
    return SMALL.get(key, getattr(GPTConfig(), key))


def test_runtime_keys_may_change(tmp_path, tiny):
    folder = _save(tmp_path / "ckpt", 20, tiny)
    changed = {"dropout": 0.0, "attention_dropout": 0.0, "recompute": "full", "sequence_parallel": False,
               "attention": "sdpa"}
    model, opt = _model(**changed)
    assert load_checkpoint(folder, model, opt, model.rng, config=_run(**changed))["step"] == 20
    assert model_changes(GPTConfig(**SMALL, position="rope"), GPTConfig(**{**SMALL, "seq_len": 32}, position="rope")) == []


def test_every_model_key_is_classified():
    fields = {f.name for f in dataclasses.fields(GPTConfig) if f.init}
    assert fields == {*MODEL_KEYS, *RUNTIME_KEYS, "seq_len"}, fields ^ {*MODEL_KEYS, *RUNTIME_KEYS, "seq_len"}
    assert not set(MODEL_KEYS) & set(RUNTIME_KEYS)


def test_saved_tensors_the_model_does_not_have_are_refused_by_name(tmp_path, tiny):
    folder = _save(tmp_path / "ckpt", 20, tiny)  # two layers
    model, opt = _model(layers=1)
    with pytest.raises(CheckpointMismatch, match=r"model\.blocks\.1\.") as raised:
        load_checkpoint(folder, model, opt, model.rng)  # no config: the tensors alone decide
    assert "optim.exp_avg.blocks.1." in str(raised.value) or "more" in str(raised.value)
    with pytest.raises(CheckpointMismatch, match=r"model\.blocks\.1\."):
        load_model_only(folder, model)


def test_other_data_is_refused_unless_allowed(tmp_path, tiny):
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 32, 5000).astype(np.uint16), rng.integers(0, 32, 5000).astype(np.uint16)
    folder = _save(tmp_path / "ckpt", 20, tiny, extra={"data_identity": data_identity(a)})
    extra = json.loads((folder / "extra.json").read_text())
    cfg = _run()
    check_compatible(folder, cfg, data_identity(a.copy()), extra)  # the same tokens elsewhere: the same data
    with pytest.raises(CheckpointMismatch, match=r"other data.*token stream.*allow_data_change"):
        check_compatible(folder, cfg, data_identity(b), extra)
    with pytest.raises(CheckpointMismatch, match=r"different tokenizer"):
        check_compatible(folder, cfg, data_identity(a, _tok()), extra)  # a tokenizer where there was none
    cfg.checkpoint.allow_data_change = True
    check_compatible(folder, cfg, data_identity(b, _tok()), extra)
    older = {k: v for k, v in data_identity(a).items() if k != "blend"}  # saved before blends were recorded
    assert data_changes(older, data_identity(a, blend=[("a.npy", 1.0)]), None) == []
    assert data_changes(data_identity(a), data_identity(a, blend=[("a.npy", 1.0)]), None) == [
        "the blend weights (one source -> a.npy 1)"]


def _tok():
    from tokenizers import Tokenizer, models
    return Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))


def _trainer(tmp: Path, tokens: str, **changes):
    from seqpar.distributed.mesh import ParallelMesh
    from seqpar.train import Trainer
    overrides = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2,
                 "model.layers": 2, "train.steps": 2, "train.micro_batch": 2, "train.eval_interval": 0,
                 "data.source": tmp / tokens, "checkpoint.dir": tmp / "ckpt", "checkpoint.interval": 0,
                 "out_dir": tmp / "out", **changes}
    return Trainer(load_run_config(None, [f"{k}={v}" for k, v in overrides.items()]), mesh=ParallelMesh.single())


def test_the_trainer_refuses_another_model_or_data_and_keeps_the_checkpoints(tmp_path):
    rng = np.random.default_rng(0)
    for name in ("a.npy", "b.npy"):
        np.save(tmp_path / name, rng.integers(0, 64, size=3000).astype(np.uint16))
    trainer = _trainer(tmp_path, "a.npy")
    try:
        trainer.fit()
    finally:
        trainer.close()
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    for tokens, changes, match in (("a.npy", {"model.layers": 1}, r"model\.layers: 2 -> 1"),
                                   ("a.npy", {"model.bias": False}, r"model\.bias: True -> False"),
                                   ("b.npy", {}, r"other data")):
        trainer = _trainer(tmp_path, tokens, **changes)
        try:
            with pytest.raises(CheckpointMismatch, match=match):
                trainer.checkpoints.resume()
        finally:
            trainer.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved
    trainer = _trainer(tmp_path, "b.npy", **{"checkpoint.allow_data_change": True, "model.dropout": 0.0})
    try:
        assert (trainer.checkpoints.resume() or 0) == 2
    finally:
        trainer.close()


# ---- 3. a full disk -------------------------------------------------------------------------------

def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_while_writing_the_rng_file_names_it(tmp_path, tiny, monkeypatch):
    root = tmp_path / "ckpt"
    good = _save(root, 10, tiny)
    real_save = torch.save

    def full_at_rng(obj, f, *args, **kwargs):  # DCP writes its shards with torch.save too
        if Path(str(f)).name == "rng_rank0.pt":
            _enospc()
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_at_rng)
    with pytest.raises(CheckpointWriteError, match=r"no space left on device writing .*step_00000020\.tmp/"
                                                   r"rng_rank0\.pt") as raised:
        _save(root, 20, tiny)
    assert "\n" not in str(raised.value)
    monkeypatch.undo()
    assert latest_checkpoint(root) == good and files.checkpoint_problem(good) is None
    assert not (root / "step_00000020.tmp").exists(), "the failed save's files are deleted, freeing their space"


def test_torch_short_write_on_a_full_disk_names_the_shard(tmp_path, tiny, monkeypatch):
    """torch's zip writer reports a full disk as ``unexpected pos``: still one line naming the file."""
    from torch.distributed.checkpoint import filesystem

    def short_write(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 6080 vs 5968")

    class Full:
        f_bavail, f_frsize = 3, 4096

    root = tmp_path / "ckpt"
    good = _save(root, 10, tiny)
    monkeypatch.setattr(filesystem, "_write_item", short_write)
    monkeypatch.setattr(os, "statvfs", lambda path: Full())
    with pytest.raises(CheckpointWriteError, match=r"no space left on device writing .*step_00000020\.tmp/"
                                                   r"__0_0\.distcp"):
        _save(root, 20, tiny)
    monkeypatch.undo()
    assert latest_checkpoint(root) == good


@pytest.mark.parametrize("target", ["complete.json", "latest.tmp"])
def test_a_full_disk_at_the_marker_or_the_pointer(tmp_path, tiny, monkeypatch, target):
    """The marker: the save fails, step 10 stays the resume. The pointer (just after the rename):
    the save fails naming latest.tmp, none is left, and the complete step 20 is what resumes."""
    import builtins
    root = tmp_path / "ckpt"
    _save(root, 10, tiny)
    real_open = builtins.open

    def full_at(path, *args, **kwargs):
        if Path(path).name == target:
            _enospc()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files, "open", full_at, raising=False)
    with pytest.raises(CheckpointWriteError, match=rf"no space left on device writing .*{target}"):
        _save(root, 20, tiny)
    monkeypatch.undo()
    expected = "step_00000020" if target == "latest.tmp" else "step_00000010"
    assert (root / "latest").read_text().strip() == "step_00000010"
    assert latest_checkpoint(root).name == expected and not (root / "latest.tmp").exists()


# ---- 4. background saves stage into reused buffers -------------------------------------------------

def test_background_saves_reuse_their_staging_buffers_and_copy_non_blocking(tmp_path, tiny, monkeypatch):
    from seqpar.checkpoint import save_load
    from seqpar.checkpoint.pieces import StagingBuffers, training_parts
    model, opt = tiny
    parts = training_parts(model, opt)
    staging = StagingBuffers()
    requested = []
    real_copy = torch.Tensor.copy_

    def recording_copy(self, src, non_blocking=False):
        requested.append(non_blocking)
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", recording_copy)
    first = staging.stage(parts)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    second = staging.stage(training_parts(model, opt))
    monkeypatch.undo()
    ptrs = lambda staged: [p.tensor.data_ptr() for dp in staged.values() for p in dp.pieces]  # noqa: E731
    assert ptrs(first) == ptrs(second) and len(set(ptrs(first))) == len(ptrs(first))
    assert requested and all(requested), "every staging copy is requested non_blocking"
    for fqn, dp in training_parts(model, opt).items():
        for src, staged in zip(dp.pieces, second[fqn].pieces):
            assert torch.equal(src.tensor, staged.tensor) and staged.tensor.data_ptr() != src.tensor.data_ptr()
    # two background saves in a row use the same process-wide buffers
    seen = []
    real_stage = StagingBuffers.stage

    def recording_stage(self, parts):
        out = real_stage(self, parts)
        seen.append((id(self), ptrs(out)))
        return out

    monkeypatch.setattr(StagingBuffers, "stage", recording_stage)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2):
            pending = save_checkpoint(tmp_path / "ckpt", step, model, opt, {"tp": 1}, dump(_run()), model.rng,
                                      keep=0, async_save=True)
            assert pending.finish().is_dir()
        save_checkpoint(tmp_path / "ckpt", 3, model, opt, {"tp": 1}, dump(_run()), model.rng, keep=0)
    assert len(seen) == 2 and seen[0] == seen[1] and seen[0][0] == id(save_load._STAGING)
    # DCP's "assuming the intent is to save in a single process" (its writer thread's too): not printed
    assert [str(w.message) for w in caught] == []
