"""The data cache's lock: a holder that never lets go fails the wait after parallel.timeout_minutes,
naming the lock file and the holder's pid and host; a waiter names the holder; the ranks of one fresh
multi-rank run say they wait for a rank of their own job, never for "another process"."""
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from seqpar.config import load_run_config
from seqpar.data import load_corpus, prepare_corpus
from seqpar.data.errors import DataError
from seqpar.data.lock import job_id, locked

# seqpar's own lock, as a build holds it
HOLD = ("import sys, time\nfrom pathlib import Path\nfrom seqpar.data.lock import locked\n"
        "with locked(Path(sys.argv[1]), None):\n    print('held', flush=True)\n    time.sleep(120)\n")
# a plain process that holds the flock and writes the record ``argv[2]`` with its own pid (starts fast)
HOLD_RECORD = ("import fcntl, json, os, sys, time\nf = open(sys.argv[1], 'a+')\nfcntl.flock(f, fcntl.LOCK_EX)\n"
               "f.truncate(0)\nf.write(json.dumps({**json.loads(sys.argv[2]), 'pid': os.getpid()}))\nf.flush()\n"
               "print('held', flush=True)\ntime.sleep(120)\n")


def _holder(path: Path, record: dict | None = None, **env):
    """A process of its own holding lock ``path`` until killed: seqpar's ``locked`` (``record``
    None), or a plain one that says ``record``."""
    argv = ["-c", HOLD, str(path)] if record is None else ["-c", HOLD_RECORD, str(path), json.dumps(record)]
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
    assert proc.stdout.readline().strip() == "held"
    return proc


def _stop(proc) -> None:
    proc.kill()
    proc.wait()


def test_a_held_lock_fails_after_the_timeout_naming_the_file_and_holder(tmp_path, monkeypatch):
    for key in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    lock = tmp_path / "corpus-x.lock"
    proc = _holder(lock)
    try:
        lines, start = [], time.monotonic()
        with pytest.raises(DataError) as err:
            with locked(lock, lines.append, timeout_s=0.5):
                pass
        assert time.monotonic() - start < 10
        host = socket.gethostname()
        assert f"lock {lock}, held by pid {proc.pid} on {host}" in str(err.value)
        assert "parallel.timeout_minutes" in str(err.value)
        assert lines == [f"data: waiting for pid {proc.pid} on {host}, which is preparing the corpus (lock {lock})"]
    finally:
        _stop(proc)
    with locked(lock, lines.append, timeout_s=0.5):  # the holder is gone: the lock is free at once
        pass


def test_the_waiter_tells_a_rank_of_its_own_job_from_another_job(tmp_path, monkeypatch):
    job = {"TORCHELASTIC_RUN_ID": "run-a", "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    for key, value in {**job, "RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    lock, host = tmp_path / "corpus-y.lock", socket.gethostname()
    for other, said in ((job_id(), "rank 1 of this job (pid {pid} on {host})"),
                        ("torchrun run-b at node0:29500", "pid {pid} on {host} (rank 1 of another job)")):
        proc = _holder(lock, {"host": host, "rank": 1, "job": other})
        try:
            lines = []
            with pytest.raises(DataError, match="held by " + said.format(pid=proc.pid, host=socket.gethostname())
                               .replace("(", r"\(").replace(")", r"\)")):
                with locked(lock, lines.append, timeout_s=0.3):
                    pass
            assert lines[0].startswith("data: waiting for " + said.format(pid=proc.pid, host=socket.gethostname()))
        finally:
            _stop(proc)


def _text(path: Path) -> Path:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(2, 8))) for _ in range(500)]
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(8000)))
    return path


def test_load_corpus_waits_at_most_parallel_timeout_minutes(tmp_path):
    source, cache = _text(tmp_path / "t.txt"), tmp_path / "cache"
    prepare_corpus(source, vocab_size=300, cache_dir=cache, log=lambda _: None)
    (lock,) = cache.glob("*.lock")
    cfg = load_run_config(None, [f"data.source={source}", f"data.cache_dir={cache}", "model.vocab_size=300",
                                 "parallel.timeout_minutes=0.01", f"out_dir={tmp_path / 'out'}",
                                 f"checkpoint.dir={tmp_path / 'ckpt'}"])
    proc = _holder(lock, {"host": "elsewhere", "rank": 0, "job": None})
    try:
        with pytest.raises(DataError, match=f"waiting for the lock {lock}, held by pid {proc.pid} on elsewhere"):
            load_corpus(cfg, lambda _: None)
    finally:
        _stop(proc)


def _prepare(rank, world, source, cache):
    import torch.distributed as dist
    lines = []
    dist.barrier()
    if rank == 0:
        time.sleep(0.3)  # rank 1 takes the lock first and builds
    prepare_corpus(source, vocab_size=300, cache_dir=cache, log=lines.append)
    return lines


def test_a_fresh_multi_rank_run_waits_for_its_own_rank(spawn, tmp_path):
    source = _text(tmp_path / "t.txt")
    logs = spawn(_prepare, 2, str(source), str(tmp_path / "cache"))
    waits = [line for lines in logs for line in lines if "waiting" in line]
    assert waits, logs  # one rank waited for the other's build
    assert all("another" not in line and " of this job (pid " in line for line in waits), waits
