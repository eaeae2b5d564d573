"""The data cache's file locks: who holds one, a bounded wait for it, and what the waiter says.

A process holding a lock (``flock`` on ``path``) writes who it is into the file: host, pid, rank
and job (one JSON line). A process that finds the lock taken names the holder: ``rank R of this
job`` when the holder is a rank of the same job (the other ranks of a fresh multi-rank run wait
for the one building the corpus), else the holder's pid and host. It then waits at most
``timeout_s`` (the run's ``parallel.timeout_minutes``) and fails naming the lock file and the
holder, so a stuck process cannot hang a run. The ``flock`` is released when its holder exits,
however it exits; a record left by a holder that died is overwritten by the next one.

What makes two ranks "the same job": torchrun's run id with its master address and port, or,
for ranks of one process group started by a local launcher (``seqpar.distributed.local``), the
same parent process on the same host. A single-process run shares its job with nobody.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

from ..distributed.collectives import group_rank, group_size, world_group
from .errors import DataError

POLL_S = 0.1        # how often a waiter tries the lock again
NAME_AFTER_S = 1.0  # a waiter that has not read the holder's record by then names it as unknown
Log = Callable[[str], None]


def _world() -> tuple[int, int]:
    """(rank, world size) of this process: the process group's, else torchrun's environment."""
    world = world_group()
    if world is not None:
        return group_rank(world), group_size(world)
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def job_id() -> str | None:
    """What the ranks of this job share and no other job does (see the module docstring); None
    for a single-process run."""
    run, addr, port = (os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    if run and addr and port:
        return f"torchrun {run} at {addr}:{port}"
    if _world()[1] > 1:
        return f"ranks of parent {os.getppid()} on {socket.gethostname()}"
    return None


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "rank": _world()[0], "job": job_id()}


def try_lock(f: IO[str]) -> bool:
    """Take the exclusive ``flock`` on open file ``f`` without waiting and record this process in
    it; False when another process holds it."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    f.seek(0)
    f.truncate()
    f.write(json.dumps(_me()) + "\n")
    f.flush()
    return True


def lock_holder(path: str | Path) -> dict | None:
    """The record the holder of lock ``path`` wrote (``host``, ``pid``, ``rank``, ``job``), or None."""
    try:
        record = json.loads(Path(path).read_text().strip() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def holder_text(record: dict | None) -> str:
    """``rank 1 of this job (pid 4242 on node7)`` or ``pid 4242 on node7 (rank 0 of another job)``."""
    if record is None:
        return "a process that has not said who it is"
    where = f"pid {record.get('pid')} on {record.get('host')}"
    mine = job_id()
    if mine is not None and record.get("job") == mine:
        return f"rank {record.get('rank')} of this job ({where})"
    return where + (f" (rank {record.get('rank')} of another job)" if record.get("job") else "")


def _wait(f: IO[str], path: Path, log: Log | None, timeout_s: float | None, what: str) -> None:
    """Poll the lock until it is ours; name the holder once; fail after ``timeout_s`` seconds."""
    start, named = time.monotonic(), False
    while True:
        record = lock_holder(path)
        waited = time.monotonic() - start
        if not named and (record is not None or waited >= NAME_AFTER_S):
            named = True
            if log is not None:
                log(f"data: waiting for {holder_text(record)}, which is {what} (lock {path})")
        if timeout_s is not None and waited >= timeout_s:
            raise DataError(f"data: gave up after {waited / 60:.3g} min (parallel.timeout_minutes) waiting for the "
                            f"lock {path}, held by {holder_text(record)}, which is {what}; stop that process if it "
                            f"is stuck, or raise parallel.timeout_minutes if it needs longer")
        time.sleep(POLL_S)
        if try_lock(f):
            return


@contextmanager
def locked(path: Path, log: Log | None, *, timeout_s: float | None = None,
           what: str = "preparing the corpus") -> Iterator[None]:
    """Hold the exclusive lock ``path`` (created if needed), waiting at most ``timeout_s``
    seconds (None: no limit) for another holder; ``log`` gets one line naming the holder when
    there is one (None: wait silently). Raises :class:`DataError` naming the lock and the holder
    when the wait runs out."""
    with open(path, "a+") as f:
        if not try_lock(f):
            _wait(f, Path(path), log, timeout_s, what)
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()  # released: no stale name for the next waiter


__all__ = ["holder_text", "job_id", "lock_holder", "locked", "try_lock"]
