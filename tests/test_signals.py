"""SIGINT / SIGTERM to ``seqpar train --nproc-per-node 2``: the ranks save at the next step
boundary, every process exits 0, one line says so, no traceback, no rank left behind."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from seqpar.checkpoint import complete_checkpoints


def _start(tmp_path, nproc: int = 2):
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 128, size=8000).astype(np.uint16))
    args = ["model.vocab_size=128", "model.seq_len=32", "model.hidden=32", "model.heads=4", "model.layers=2",
            "train.micro_batch=4", "train.eval_interval=0", "checkpoint.resume=never", "train.steps=2000",
            "train.log_interval=1", "checkpoint.interval=0", f"data.source={tmp_path / 'tokens.npy'}",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'out'}"]
    log = tmp_path / "log.txt"
    launch = ["--nproc-per-node", str(nproc)] if nproc > 1 else []
    proc = subprocess.Popen([sys.executable, "-m", "seqpar.cli", "train"] + launch + args,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=tmp_path,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    t0 = time.time()
    while not re.search(r"step +3/", log.read_text()):  # training has started
        assert proc.poll() is None and time.time() - t0 < 180, log.read_text()[-3000:]
        time.sleep(0.3)
    return proc, log


def _ranks(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_launcher_saves_and_exits_0(tmp_path, sig):
    proc, log = _start(tmp_path)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2, ranks
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert f"{sig.name} received: checkpoint written at step" in out and "Traceback" not in out, out[-3000:]
    assert "SIGTERM" not in out or sig == signal.SIGTERM, out[-3000:]  # a Ctrl-C is named as one
    assert complete_checkpoints(tmp_path / "ckpt"), out[-3000:]
    assert not any(os.path.exists(f"/proc/{pid}") for pid in ranks), "a rank outlived the launcher"


def test_ctrl_c_to_one_process_saves_and_exits_0(tmp_path):
    proc, log = _start(tmp_path, nproc=1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    out = log.read_text()
    assert "SIGINT received: checkpoint written at step" in out and "Traceback" not in out, out[-3000:]
    assert complete_checkpoints(tmp_path / "ckpt"), out[-3000:]


def test_a_second_ctrl_c_aborts_at_once_and_leaves_no_rank(tmp_path):
    proc, log = _start(tmp_path)
    ranks = _ranks(proc.pid)
    assert len(ranks) == 2, ranks
    for pid in ranks:  # ranks that cannot reach their next step boundary (a hung collective, say)
        os.kill(pid, signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)  # the first asks for a save the stopped ranks never make
    # the launcher counts a SIGINT within a second of the first as the same keypress; on a loaded
    # machine its handler can run late, so the second comes well after that second
    time.sleep(3.0)
    assert proc.poll() is None, "the first Ctrl-C alone must not end the job"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130, log.read_text()[-3000:]
    out = log.read_text()
    assert "seqpar train: interrupted" in out and "Traceback" not in out, out[-3000:]
    time.sleep(0.5)
    assert not any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split(")")[1][:3]
                   for pid in ranks), "a rank outlived the launcher"
