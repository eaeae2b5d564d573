"""Checkpoints in whole runs: resume is bit-exact and reshards across layouts, a killed rank's job
restarts from the newest complete checkpoint (by hand and by torchrun), SIGTERM saves, and a
checkpoint's metadata cannot run code."""
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from seqpar.checkpoint import complete_checkpoints

from run_helpers import learnable_overrides, train_rank, wait_for


def test_resume_is_exact_and_reshards(spawn, tmp_path):
    full = learnable_overrides(tmp_path, **{"parallel.tp": 2, "checkpoint.interval": 10, "checkpoint.keep": 3,
                                   "checkpoint.resume": "auto",
                                   "model.dropout": 0.1, "model.attention_dropout": 0.1})
    uninterrupted = spawn(train_rank, 2, full, 2, 1)[0]["losses"]
    ckpts = complete_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000020"]
    # a crash after step 10: only the step-10 checkpoint survives, plus a half-written save
    shutil.rmtree(ckpts[-1])
    (tmp_path / "ckpt" / "step_00000020.tmp").mkdir()
    resumed = spawn(train_rank, 2, full, 2, 1)[0]["losses"]
    assert resumed == uninterrupted[10:], "resumed losses must equal the uninterrupted run's, bit for bit"
    # the step-10 checkpoint saved at t=2 loads at t=1 (resharding); dropout off for a layout-free comparison
    ref = spawn(train_rank, 2, learnable_overrides(tmp_path, **{"parallel.tp": 2, "checkpoint.dir": str(tmp_path / "c2"),
                                                   "checkpoint.interval": 10, "checkpoint.resume": "auto"}),
                2, 1)[0]["losses"]
    shutil.rmtree(tmp_path / "c2" / "step_00000020")
    at_t1 = spawn(train_rank, 1, learnable_overrides(tmp_path, **{"parallel.tp": 1, "checkpoint.dir": str(tmp_path / "c2"),
                                                     "checkpoint.interval": 10, "checkpoint.resume": "auto",
                                                     "model.sequence_parallel": False}), 1, 1)[0]["losses"]
    assert len(at_t1) == 10
    np.testing.assert_allclose(at_t1, ref[10:], rtol=1e-4, atol=1e-4)


def _torchrun(tmp_path, overrides, log: Path, nproc=2, restarts=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "-m", "seqpar.train"] + overrides
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def _workers(proc) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def test_killed_rank_then_restart_resumes_and_sigterm_saves(tmp_path):
    ov = learnable_overrides(tmp_path, **{"parallel.tp": 2, "train.steps": 400, "checkpoint.interval": 5,
                                 "checkpoint.resume": "auto", "train.log_interval": 1})
    log = tmp_path / "torchrun.log"
    proc = _torchrun(tmp_path, ov, log)
    wait_for(lambda: complete_checkpoints(tmp_path / "ckpt"), proc, log, "a first checkpoint")
    os.kill(_workers(proc)[1], signal.SIGKILL)  # one rank dies mid-run: the job fails instead of hanging
    assert proc.wait(timeout=120) != 0
    saved = int(complete_checkpoints(tmp_path / "ckpt")[-1].name.split("_")[1])
    # the restarted job resumes from the newest complete checkpoint
    log2 = tmp_path / "torchrun2.log"
    proc = _torchrun(tmp_path, ov, log2)
    wait_for(lambda: "resumed from" in log2.read_text() and
          "step" in log2.read_text().split("resumed from")[-1], proc, log2, "a resumed training step")
    assert f"at step {saved}" in log2.read_text().split("resumed from")[1].splitlines()[0]
    for pid in _workers(proc):  # SIGTERM asks the workers to checkpoint and stop cleanly
        os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=120)
    out = log2.read_text()
    assert "SIGTERM received: checkpoint written at step" in out, out[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert int(complete_checkpoints(tmp_path / "ckpt")[-1].name.split("_")[1]) > saved


def test_torchrun_restarts_a_killed_rank_in_place_and_resumes(tmp_path):
    ov = learnable_overrides(tmp_path, **{"parallel.tp": 2, "train.steps": 400, "checkpoint.interval": 5,
                                 "checkpoint.resume": "auto", "train.log_interval": 1})
    log = tmp_path / "torchrun.log"
    proc = _torchrun(tmp_path, ov, log, restarts=1)
    wait_for(lambda: complete_checkpoints(tmp_path / "ckpt"), proc, log, "a first checkpoint")
    os.kill(_workers(proc)[1], signal.SIGKILL)  # torchrun restarts the whole worker group
    wait_for(lambda: "resumed from" in log.read_text() and
          "step" in log.read_text().split("resumed from")[-1], proc, log, "a resumed training step")
    for pid in _workers(proc):
        os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=120)
    out = log.read_text()
    assert "SIGTERM received: checkpoint written at step" in out and proc.returncode == 0, out[-3000:]


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    import pickle

    from seqpar.checkpoint import SafeReader
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        SafeReader(tmp_path).read_metadata()
