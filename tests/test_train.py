"""End-to-end training on CPU gloo: loss falls, layouts agree, resume and resharding are exact."""
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.checkpoint import complete_checkpoints


def _token_file(path: Path) -> str:
    """A learnable stream: noisy repetitions of a few fixed phrases."""
    rng = np.random.default_rng(0)
    phrases = [rng.integers(0, 128, size=12) for _ in range(6)]
    out = np.concatenate([phrases[i] for i in rng.integers(0, 6, size=4000)]).astype(np.uint16)
    np.save(path, out)
    return str(path)


def _overrides(tmp: Path, **kw) -> list[str]:
    base = {"model.vocab_size": 128, "model.seq_len": 32, "model.hidden": 32, "model.heads": 4,
            "model.layers": 2, "model.dropout": 0.0, "model.attention_dropout": 0.0,
            "train.steps": 20, "train.micro_batch": 4, "train.lr": 3e-3, "train.warmup_steps": 3,
            "train.log_interval": 5, "train.eval_interval": 0, "train.seed": 7,
            "data.source": _token_file(tmp / "tokens.npy") if not (tmp / "tokens.npy").exists() else str(tmp / "tokens.npy"),
            "checkpoint.dir": str(tmp / "ckpt"), "checkpoint.interval": 0, "checkpoint.resume": "never", "out_dir": str(tmp / "out")}
    base.update(kw)
    return [f"{k}={v}" for k, v in base.items()]


def _train(rank, world, overrides, tp, dp):
    from seqpar.train import train
    cfg = load_run_config(None, overrides)
    mesh = init_parallel(tp=tp, dp=dp)
    return train(cfg, mesh=mesh)


def test_tp2_sp_selective_loss_falls(spawn, tmp_path):
    ov = _overrides(tmp_path, **{"train.steps": 30, "model.recompute": "selective", "model.sequence_parallel": True,
                                 "parallel.tp": 2})
    h = spawn(_train, 2, ov, 2, 1)
    losses = h[0]["losses"]
    assert len(losses) == 30 and h[0]["losses"] == h[1]["losses"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses


def _tp2_then_dp2(rank, world, tp2, dp2):
    """Two layouts of 2 ranks in one spawn: t=2 (SP), then dp=2 with half the micro-batch."""
    return _train(rank, world, tp2, 2, 1)["losses"], _train(rank, world, dp2, 1, 2)["losses"]


def test_layouts_give_the_same_loss_curve(spawn, tmp_path):
    """(Gradient accumulation over dp ranks against one rank: tests/test_trainer.py and tests/test_fsdp.py.)"""
    common = {"model.recompute": "selective"}
    ref = spawn(_train, 1, _overrides(tmp_path, **common, **{"model.sequence_parallel": False}), 1, 1)[0]["losses"]
    # dp=2 with half the micro-batch sees exactly the same windows per step as dp=1
    tp2, dp2 = spawn(_tp2_then_dp2, 2, _overrides(tmp_path, **common, **{"parallel.tp": 2}),
                     _overrides(tmp_path, **common, **{"train.micro_batch": 2, "model.sequence_parallel": False}))[0]
    for curve in (tp2, dp2):
        assert len(curve) == 20
        np.testing.assert_allclose(curve, ref, rtol=1e-4, atol=1e-4)


def test_resume_is_exact_and_reshards(spawn, tmp_path):
    full = _overrides(tmp_path, **{"parallel.tp": 2, "checkpoint.interval": 10, "checkpoint.keep": 3,
                                   "checkpoint.resume": "auto",
                                   "model.dropout": 0.1, "model.attention_dropout": 0.1})
    uninterrupted = spawn(_train, 2, full, 2, 1)[0]["losses"]
    ckpts = complete_checkpoints(tmp_path / "ckpt")
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000020"]
    # a crash after step 10: only the step-10 checkpoint survives, plus a half-written save
    shutil.rmtree(ckpts[-1])
    (tmp_path / "ckpt" / "step_00000020.tmp").mkdir()
    resumed = spawn(_train, 2, full, 2, 1)[0]["losses"]
    assert resumed == uninterrupted[10:], "resumed losses must equal the uninterrupted run's, bit for bit"
    # the step-10 checkpoint saved at t=2 loads at t=1 (resharding); dropout off for a layout-free comparison
    ref = spawn(_train, 2, _overrides(tmp_path, **{"parallel.tp": 2, "checkpoint.dir": str(tmp_path / "c2"),
                                                   "checkpoint.interval": 10, "checkpoint.resume": "auto"}),
                2, 1)[0]["losses"]
    shutil.rmtree(tmp_path / "c2" / "step_00000020")
    at_t1 = spawn(_train, 1, _overrides(tmp_path, **{"parallel.tp": 1, "checkpoint.dir": str(tmp_path / "c2"),
                                                     "checkpoint.interval": 10, "checkpoint.resume": "auto",
                                                     "model.sequence_parallel": False}), 1, 1)[0]["losses"]
    assert len(at_t1) == 10
    np.testing.assert_allclose(at_t1, ref[10:], rtol=1e-4, atol=1e-4)


def _bad(rank, world, overrides):
    from seqpar.train import train
    try:
        train(load_run_config(None, overrides), mesh=init_parallel(tp=2))
    except ValueError as e:
        return str(e)
    return None


def test_bad_configs_fail_on_every_rank(spawn, tmp_path):
    msgs = spawn(_bad, 2, _overrides(tmp_path, **{"parallel.tp": 2, "model.heads": 3, "model.hidden": 33}))
    assert all(m and "t=2" in m and "heads (3)" in m for m in msgs), msgs
    with pytest.raises(ValueError, match=r"unknown key 'train.stepz'"):
        load_run_config(None, ["train.stepz=3"])
    with pytest.raises(ValueError, match=r"train.steps"):
        load_run_config(None, ["train.steps=many"])


def _torchrun(tmp_path, overrides, log: Path, nproc=2, restarts=0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--max-restarts={restarts}", "-m", "seqpar.train"] + overrides
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def _workers(proc) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _wait(cond, proc, log: Path, what: str, timeout=180) -> None:
    t0 = time.time()
    while not cond():
        if proc.poll() is not None or time.time() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"{what} did not happen:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def test_killed_rank_then_restart_resumes_and_sigterm_saves(tmp_path):
    ov = _overrides(tmp_path, **{"parallel.tp": 2, "train.steps": 400, "checkpoint.interval": 5,
                                 "checkpoint.resume": "auto", "train.log_interval": 1})
    log = tmp_path / "torchrun.log"
    proc = _torchrun(tmp_path, ov, log)
    _wait(lambda: complete_checkpoints(tmp_path / "ckpt"), proc, log, "a first checkpoint")
    os.kill(_workers(proc)[1], signal.SIGKILL)  # one rank dies mid-run: the job fails instead of hanging
    assert proc.wait(timeout=120) != 0
    saved = int(complete_checkpoints(tmp_path / "ckpt")[-1].name.split("_")[1])
    # the restarted job resumes from the newest complete checkpoint
    log2 = tmp_path / "torchrun2.log"
    proc = _torchrun(tmp_path, ov, log2)
    _wait(lambda: "resumed from" in log2.read_text() and
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
    ov = _overrides(tmp_path, **{"parallel.tp": 2, "train.steps": 400, "checkpoint.interval": 5,
                                 "checkpoint.resume": "auto", "train.log_interval": 1})
    log = tmp_path / "torchrun.log"
    proc = _torchrun(tmp_path, ov, log, restarts=1)
    _wait(lambda: complete_checkpoints(tmp_path / "ckpt"), proc, log, "a first checkpoint")
    os.kill(_workers(proc)[1], signal.SIGKILL)  # torchrun restarts the whole worker group
    _wait(lambda: "resumed from" in log.read_text() and
          "step" in log.read_text().split("resumed from")[-1], proc, log, "a resumed training step")
    for pid in _workers(proc):
        os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=120)
    out = log.read_text()
    assert "SIGTERM received: checkpoint written at step" in out and proc.returncode == 0, out[-3000:]


def test_cli_rejects_bad_config_before_starting(capsys):
    from seqpar.cli import main
    assert main(["train", "train.stepz=3"]) == 2
    assert "unknown key 'train.stepz'" in capsys.readouterr().err
    assert main(["train", "model.heads=3", "model.hidden=33", "parallel.tp=2"]) == 2
    assert "heads (3)" in capsys.readouterr().err


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_checkpoint_metadata_cannot_run_code(tmp_path):
    import pickle

    from seqpar.checkpoint import SafeReader
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Evil()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        SafeReader(tmp_path).read_metadata()


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16"])
def test_bf16_on_cpu_trains(spawn, tmp_path, precision):
    ov = _overrides(tmp_path, **{"parallel.tp": 2, "train.steps": 6, "train.precision": precision,
                                 "model.recompute": "selective"})
    losses = spawn(_train, 2, ov, 2, 1)[0]["losses"]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]
