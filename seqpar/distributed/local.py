"""Run one function on N local gloo ranks (processes on this machine) and collect what each returns.

Used by the tests, the benchmark runner, ``seqpar memory --measure`` and the scripts. Each rank is
a fresh process that joins a gloo process group through a ``file://`` rendezvous in a private
temp dir (no port is ever guessed), runs ``fn(rank, world_size, *args)`` with one intra-op thread
and never sees a GPU (unless ``gpus=True``: the GPU checks put two gloo ranks on one GPU). The
first rank to fail stops the others and its error, traceback included, is raised in the caller; a
run past ``timeout`` is killed.

:func:`fake_world` is the other kind of local rank: this process as one rank of a world whose
collectives return at once and send nothing (``seqpar train --dry-run``).

Ranks are forked from a ``forkserver`` that imported torch and seqpar once (a spawned interpreter
spends seconds on those imports, and a test suite starts hundreds of ranks); the server itself
never runs a torch op, so no thread pool is forked. Each rank gets the caller's environment as it
is at the call (the server's is the one it started with).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

POLL_S = 0.02  # how often the parent looks at its ranks


class RankFailed(RuntimeError):
    """A rank of :func:`run_local` raised (or died); ``rank`` and ``traceback`` say where and how."""

    def __init__(self, rank: int, world_size: int, error: str, tb: str) -> None:
        super().__init__(f"rank {rank} of {world_size} failed: {error}\n--- traceback of rank {rank} ---\n{tb}")
        self.rank, self.error, self.traceback = rank, error, tb


PRELOAD = ["torch", "torch.distributed", "numpy", "seqpar", "seqpar.model", "seqpar.train", "seqpar.parallel"]


def _context():
    """The forkserver context, its server preloading :data:`PRELOAD` (set before it first starts);
    ``spawn`` where the platform has no forkserver."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_main(rank: int, world_size: int, run_dir: str, payload: bytes, threads: int,
               collective_timeout_s: float, environ: dict[str, str] | None = None) -> None:
    """Child process: join the group, run the function, leave ``rank{r}.ok`` or ``rank{r}.err``."""
    if environ is not None:  # the caller's environment at the call, not the server's at its start
        os.environ.clear()
        os.environ.update(environ)
    import torch
    import torch.distributed as dist

    try:
        fn, args = pickle.loads(payload)  # imports the caller's module
        torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method=f"file://{run_dir}/rendezvous", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=collective_timeout_s))
        record = pickle.dumps(fn(rank, world_size, *args))
    except BaseException as e:  # noqa: BLE001 - every failure, SystemExit included, goes to the parent
        # written first, so the parent stops the other ranks before they time out in a collective
        _write(Path(run_dir) / f"rank{rank}.err", (time.time(), f"{type(e).__name__}: {e}", traceback.format_exc()))
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(1) from None
    dist.destroy_process_group()
    _write(Path(run_dir) / f"rank{rank}.ok", record)


def _write(path: Path, data: bytes | tuple) -> None:
    """Write ``data`` (pickled if not bytes) so that the parent sees the file complete or not at all."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data if isinstance(data, bytes) else pickle.dumps(data))
    os.replace(tmp, path)


def _first_failure(procs: list, run_dir: Path) -> tuple[float, int, str, str] | None:
    """(time, rank, error, traceback) of the earliest rank that failed so far, or None."""
    failures = []
    for rank, p in enumerate(procs):
        err = run_dir / f"rank{rank}.err"
        if err.is_file():
            when, error, tb = pickle.loads(err.read_bytes())
            failures.append((when, rank, error, tb))
        elif p.exitcode not in (None, 0) or (p.exitcode == 0 and not (run_dir / f"rank{rank}.ok").is_file()):
            # died without a Python error (a signal, os._exit) or exited without a result
            failures.append((time.time(), rank, f"process exited with code {p.exitcode} and no result",
                             "(none: no Python exception)"))
    return min(failures) if failures else None


@contextlib.contextmanager
def _gpus_hidden() -> Iterator[None]:
    """``CUDA_VISIBLE_DEVICES=""`` while ranks start, so CUDA is invisible to a child from its first
    import on (whatever its modules do at import time); the caller's value is put back after."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _stop(procs: list) -> None:
    """Terminate every live rank, then kill any that ignores it (ranks that never started are skipped)."""
    procs = [p for p in procs if p.pid is not None]
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.is_alive():
            p.kill()
            p.join()


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float | None = 600.0,
              threads: int = 1, collective_timeout: float = 60.0, tmp_dir: str | Path | None = None,
              gpus: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` CPU gloo ranks; return the results in rank order.

    ``fn`` must be a module-level function; it and ``args`` are pickled, its result too. The
    default process group is initialised around the call (``collective_timeout`` seconds per
    collective). Raises :class:`RankFailed` for the first rank that fails (the others are
    stopped) and ``TimeoutError`` after ``timeout`` seconds (``None``: no limit), hung ranks killed.
    ``gpus=True`` leaves this process's GPUs visible to the ranks (still one gloo group); they are
    then spawned fresh, not forked from the server, so no CUDA state is ever inherited.
    """
    if world_size < 1 or threads < 1:
        raise ValueError(f"run_local needs world_size >= 1 and threads >= 1, got {world_size} and {threads}")
    try:
        payload = pickle.dumps((fn, args))
    except Exception as e:
        raise TypeError(f"run_local: {getattr(fn, '__qualname__', fn)!r} and its args must be picklable "
                        f"(a module-level function): {e}") from None
    ctx = mp.get_context("spawn") if gpus else _context()
    with tempfile.TemporaryDirectory(prefix="seqpar-ranks-", dir=tmp_dir) as d:
        run_dir, procs = Path(d), []
        try:
            # the ranks (and a forkserver starting now) see no GPU, unless asked to
            with contextlib.nullcontext() if gpus else _gpus_hidden():
                environ = dict(os.environ)
                procs = [ctx.Process(target=_rank_main, name=f"seqpar-rank{r}",
                                     args=(r, world_size, d, payload, threads, collective_timeout, environ))
                         for r in range(world_size)]
                for p in procs:
                    p.start()
            _wait(procs, run_dir, timeout, fn)
            return [pickle.loads((run_dir / f"rank{r}.ok").read_bytes()) for r in range(world_size)]
        finally:
            _stop(procs)


def _wait(procs: list, run_dir: Path, timeout: float | None, fn: Callable) -> None:
    """Return once every rank exited cleanly; raise on the first failure or at the deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        failure = _first_failure(procs, run_dir)
        if failure is not None:
            _stop(procs)
            _, rank, error, tb = _first_failure(procs, run_dir) or failure  # earliest, now all are stopped
            raise RankFailed(rank, len(procs), error, tb)
        if all(p.exitcode == 0 for p in procs):
            return
        if deadline is not None and time.monotonic() > deadline:
            hung = [r for r, p in enumerate(procs) if p.exitcode is None]
            _stop(procs)
            raise TimeoutError(f"run_local: rank(s) {hung} of {len(procs)} still running "
                               f"{getattr(fn, '__qualname__', fn)} after {timeout:g} s; killed")
        time.sleep(POLL_S)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int) -> Iterator[None]:
    """This process as rank ``rank`` of ``world_size`` fake ranks (``torch.testing``'s ``FakeStore``,
    backend ``"fake"``: collectives return at once, nothing is sent) for the block, destroyed after.
    Needs a process without a process group."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
