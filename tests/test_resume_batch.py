"""A resume at another data-parallel size trains the checkpoint's global batch: docs/checkpoints.md's
relayout example (4 processes t=2 -> 4 processes t=1 ddp) gives the uninterrupted run's losses, and a
dp that cannot split the saved batch is refused naming both batches."""
import shutil

import numpy as np
import pytest

from seqpar import init_parallel
from seqpar.checkpoint import complete_checkpoints, saved_global_batch
from seqpar.config import load_run_config
from seqpar.train import Trainer
from seqpar.train.resolve import resolve_run

from run_helpers import learnable_overrides


def _cfg(*overrides):
    return load_run_config(None, ["model.layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=16",
                                  "model.vocab_size=64", *overrides])


def test_resolve_keeps_the_saved_global_batch_at_another_dp():
    # the docs' example: saved at dp=2 x micro_batch 8 = 16; at dp=4 micro-batches of 4 keep 16
    run = resolve_run(_cfg("train.micro_batch=8"), world_size=4, saved_global_batch=16)
    assert (run.dp, run.cfg.train.micro_batch, run.accum, run.global_batch) == (4, 4, 1, 16)
    assert "global batch of 16 sequences at dp=4: train.micro_batch 8 -> 4, accumulation 1" in run.batch_note
    # fewer ranks: the micro-batch stays, accumulation makes up the rest
    run = resolve_run(_cfg("train.micro_batch=8"), world_size=2, saved_global_batch=32)
    assert (run.cfg.train.micro_batch, run.accum, run.global_batch) == (8, 2, 32)
    # the same dp: nothing changes, nothing to say
    run = resolve_run(_cfg("train.micro_batch=8"), world_size=2, saved_global_batch=16)
    assert (run.cfg.train.global_batch, run.accum, run.batch_note) == (None, 1, None)
    # an explicit train.global_batch is the user's change: kept, and said
    run = resolve_run(_cfg("train.micro_batch=4", "train.global_batch=32"), world_size=4, saved_global_batch=16)
    assert run.global_batch == 32 and "train.global_batch=32 replaces the checkpoint's global batch of 16" in \
        run.batch_note
    # pipeline stages: enough micro-batches for 1F1B (at least pp)
    run = resolve_run(_cfg("train.micro_batch=8", "parallel.pp=2"), world_size=2, saved_global_batch=8)
    assert (run.cfg.train.micro_batch, run.accum) == (4, 2)  # saved at the same dp: the usual pp split
    run = resolve_run(_cfg("train.micro_batch=4", "parallel.pp=2"), world_size=2, saved_global_batch=8)
    assert (run.cfg.train.micro_batch, run.accum, run.global_batch) == (4, 2, 8)


def test_resolve_refuses_a_dp_that_cannot_split_the_saved_batch():
    with pytest.raises(ValueError, match=r"global batch of 6 sequences, which dp=4 .* micro_batch x dp = 3 x 4 "
                                         r"would train 12\)"):
        resolve_run(_cfg("train.micro_batch=3"), world_size=4, saved_global_batch=6)


def _relayout(rank, world, tmp, overrides, tp, mode):
    trainer = Trainer(load_run_config(None, [*overrides, f"parallel.tp={tp}", f"parallel.data_parallel={mode}"]),
                      mesh=init_parallel(tp=tp, dp=world // tp))
    out = {"micro_batch": trainer.run.cfg.train.micro_batch, "accum": trainer.run.accum, "note": trainer.run.batch_note}
    out["losses"] = trainer.fit()["losses"]
    return out


def test_docs_relayout_example_resumes_with_the_uninterrupted_losses(spawn, tmp_path):
    # tiny-cpu's shape of the example: micro_batch x dp, no train.global_batch
    ov = learnable_overrides(tmp_path, **{"train.steps": 4, "train.micro_batch": 2, "checkpoint.interval": 2,
                                          "checkpoint.keep": 3, "checkpoint.resume": "auto"})
    whole = spawn(_relayout, 4, str(tmp_path), ov, 2, "fsdp")[0]
    assert (whole["micro_batch"], whole["accum"], whole["note"]) == (2, 1, None) and len(whole["losses"]) == 4
    ckpts = complete_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in ckpts] == ["step_00000002", "step_00000004"]
    assert saved_global_batch(tmp_path / "ckpt") == 4  # 2 x dp=2
    shutil.rmtree(ckpts[-1])  # stopped after the step-2 checkpoint
    resumed = spawn(_relayout, 4, str(tmp_path), ov, 1, "ddp")[0]
    assert (resumed["micro_batch"], resumed["accum"]) == (1, 1), resumed
    assert "global batch of 4 sequences at dp=4: train.micro_batch 2 -> 1" in resumed["note"]
    np.testing.assert_allclose(resumed["losses"], whole["losses"][2:], rtol=1e-5, atol=1e-5)



def _fake_checkpoint(root, step: int, extra: str) -> None:
    """A complete checkpoint folder as far as the marker goes (enough for reading extra.json)."""
    from seqpar.checkpoint.files import _seal
    folder = root / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"\0")
    (folder / "extra.json").write_text(extra)
    _seal(folder, step)


def test_saved_global_batch_reads_the_checkpoint_a_resume_would_load(tmp_path):
    assert saved_global_batch(tmp_path / "nothing") is None
    _fake_checkpoint(tmp_path / "a", 3, '{"step": 3, "data": {"step": 3, "seed": 1, "global_batch": 16}}')
    assert saved_global_batch(tmp_path / "a") == 16
    _fake_checkpoint(tmp_path / "a", 5, "{not json")  # the newest is unreadable: the resume falls back too
    assert saved_global_batch(tmp_path / "a") == 16
    # seqpar import's step 0 has trained nothing: its placeholder batch is not kept
    _fake_checkpoint(tmp_path / "b", 0, '{"data": {"step": 0, "seed": 1, "global_batch": 2}, "tp": 1, "dp": 1}')
    assert saved_global_batch(tmp_path / "b") is None
