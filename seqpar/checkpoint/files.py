"""The filesystem side of checkpoints: which folders are complete, sealing one, and one job per dir.

A checkpoint counts only if its ``complete.json`` marker lists every file with its size (written
last, after fsyncing every file and the folder); the marker also records each file's checksum
(verified on load, :mod:`seqpar.checkpoint.integrity`) and the save's sequence number, which
decides what a resume picks (``latest`` is advisory). The save/load side is :mod:`seqpar.checkpoint.save_load`.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path


from ..distributed.collectives import all_gather_object, world_group
from .errors import CheckpointError, CheckpointInUse, CheckpointWriteError, write_error
from .integrity import ALGORITHM, file_checksum
from .safe_metadata import capped_repr

PREFIX = "step_"
MARKER = "complete.json"
LOCK = ".lock"
OUT_LOCK = ".out.lock"  # a running job's hold on its out_dir (metrics.jsonl, TensorBoard)
_STEP = re.compile(r"step_(\d+)")


# ---- completeness ------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    """Make ``path`` (a file, or a folder's entries) durable."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int | None:
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _marker(folder: Path) -> dict:
    """The folder's ``complete.json`` as a dict (``{}`` when absent or unreadable)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _sequence(folder: Path) -> int:
    """The save's place in the dir's order of saves (``-1`` for markers without one)."""
    seq = _marker(folder).get("sequence")
    return seq if type(seq) is int else -1


def _seal(folder: Path, step: int, sums: dict[str, str] | None = None) -> None:
    """fsync every file and folder under ``folder``, then write the marker last and fsync it and
    ``folder``. The marker lists each file's size and checksum (``sums`` holds those the ranks
    computed; rank 0 checksums the rest) and the save's sequence number, one above every other
    checkpoint's in the dir: the newest save, whatever its step, is what a resume picks."""
    files: dict[str, int] = {}
    for p in sorted(folder.rglob("*")):
        if p.name != MARKER:
            _fsync(p)
            if p.is_file():
                files[p.relative_to(folder).as_posix()] = p.stat().st_size
    _fsync(folder)
    crcs = {name: (sums or {}).get(name) or file_checksum(folder / name) for name in files}
    sequence = 1 + max([_sequence(p) for p in _step_folders(folder.parent)] + [-1])
    path = folder / MARKER
    try:
        with open(path, "w") as f:
            json.dump({"step": step, "files": files, ALGORITHM: crcs, "sequence": sequence}, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise write_error(e, path) from None
    _fsync(folder)


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint (no marker, a listed file missing or of another
    size), or ``None`` when it is."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER}"
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER} ({e})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not {".metadata", "extra.json"} <= set(files):
        return f"{MARKER} does not list the checkpoint's files"
    crcs = marker.get(ALGORITHM, {})
    if not isinstance(crcs, dict) or (crcs and set(crcs) != set(files)):
        return f"{MARKER} does not list a checksum for each file"
    if _step_of(folder) is not None and marker.get("step") != _step_of(folder):
        return f"{MARKER} is for step {capped_repr(marker.get('step'))}"
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except (OSError, TypeError, ValueError):
            return f"{capped_repr(name)} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {MARKER} says {capped_repr(size)}"
    return None


def _step_folders(root: Path) -> list[Path]:
    """``step_N`` folders under ``root`` (complete or not), highest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None), key=_step_of, reverse=True)


def _pointer(root: Path) -> str | None:
    """The folder name ``latest`` holds, when it names a checkpoint folder."""
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    return name if _STEP.fullmatch(name) else None


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, lowest step first (steps compared as integers)."""
    return [p for p in reversed(_step_folders(Path(root))) if checkpoint_problem(p) is None]


def recorded_checksums(folder: str | Path) -> dict[str, str]:
    """``{file: checksum}`` the marker records (``{}`` for checkpoints written without them)."""
    crcs = _marker(Path(folder)).get(ALGORITHM)
    return crcs if isinstance(crcs, dict) else {}


def resume_order(root: str | Path) -> tuple[list[Path], list[str]]:
    """Complete checkpoints under ``root``, the one to resume from first: newest save first (the
    marker's sequence number), so neither a stale ``latest`` nor an older run's higher steps in the
    same dir win; among checkpoints written without a sequence, the one ``latest`` names, then the
    highest step. Also returns why each incomplete checkpoint ahead of the first complete one (or
    of a higher step) was skipped."""
    root = Path(root)
    named = _pointer(root)
    folders = sorted(_step_folders(root), key=lambda p: (_sequence(p), p.name == named, _step_of(p)), reverse=True)
    complete, skipped = [], []
    for p in folders:
        problem = checkpoint_problem(p)
        if problem is None:
            complete.append(p)
        elif not complete or _step_of(p) > _step_of(complete[0]):  # one a resume would have wanted
            skipped.append(f"checkpoint {p} is incomplete ({problem})")
    return complete, skipped


def to_stderr(message: str) -> None:
    """The default ``log`` of the functions that report what they skipped: one line on stderr."""
    print(message, file=sys.stderr, flush=True)


def latest_checkpoint(root: str | Path, log: Callable[[str], None] = to_stderr) -> Path | None:
    """The checkpoint to resume from (the first of :func:`resume_order`); ``log`` gets one line
    naming each incomplete checkpoint it skipped. ``None`` when there is none. ``latest`` is
    advisory (for people and tools): a save that could not rewrite it is still the one resumed."""
    complete, skipped = resume_order(root)
    chosen = complete[0] if complete else None
    for why in skipped:
        log(f"{why} and was skipped; using {chosen or 'no checkpoint'}")
    return chosen


# ---- committing ----------------------------------------------------------------------------

def _write_pointer(root: Path, name: str) -> None:
    """Replace ``latest`` atomically (and durably) with ``name``. On failure (a full disk) no
    ``latest.tmp`` is left; ``latest`` is advisory, so the new checkpoint is still the one resumed."""
    pointer = root / "latest.tmp"
    try:
        with open(pointer, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(pointer, root / "latest")
    except OSError as e:
        pointer.unlink(missing_ok=True)
        error = write_error(e, pointer)
        raise CheckpointWriteError(f"{error}; {root / name} is complete and is what a resume picks") from None
    _fsync(root)


def _commit(root: Path, tmp: Path, final: Path) -> None:
    """Move the sealed ``tmp`` into place as ``final``. An existing ``final`` is set aside first and
    deleted only once the new one is in and ``latest`` names it, so a complete copy always exists."""
    aside = root / f"{final.name}.old"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(root)
    _write_pointer(root, final.name)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(root: Path, final: Path, keep: int, pinned: Path | None = None) -> None:
    """Keep ``keep`` checkpoints: ``final`` and the next ones in :func:`resume_order` (the newest
    saves), and ``pinned`` whatever its age (the trainer's last good checkpoint, so at most
    ``keep + 1`` remain). ``keep <= 0`` keeps everything."""
    if keep <= 0:
        return
    others = [p for p in resume_order(root)[0] if p.name != final.name]
    pin = Path(pinned).resolve() if pinned is not None else None
    for old in others[max(keep - 1, 0):]:
        if old.resolve() != pin:
            shutil.rmtree(old, ignore_errors=True)


# ---- one job per checkpoint dir ----------------------------------------------------------------

class CheckpointDir:
    """A job's hold on its checkpoint dir (see :func:`open_checkpoint_dir`); :meth:`close` releases it."""

    def __init__(self, root: Path, lock_name: str = LOCK, key: str = "checkpoint.dir"):
        self.root, self.lock_name, self.key = root, lock_name, key
        self._lock_file = None  # open and flock-ed on the first rank
        self.others: list[CheckpointDir] = []  # more folders this job holds (out_dir), released with it

    def lock(self) -> None:
        """Take the exclusive lock or raise :class:`CheckpointInUse` naming the holder (host, pid, since)."""
        what = f"{'checkpoint dir' if self.key == 'checkpoint.dir' else self.key} {self.root}"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            f = open(self.root / self.lock_name, "a+")
        except OSError as e:  # checkpoint.dir names a file, or a folder this user may not write
            raise CheckpointError(f"cannot use {what}: {e.strerror or e}") from e
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read(400).strip() or "unknown holder"
            f.close()
            raise CheckpointInUse(f"{what} is in use by another job ({holder}); two jobs must not share "
                                  f"{self.key}: give this one its own or stop the other") from None
        except OSError as e:
            f.close()
            raise CheckpointInUse(f"cannot lock {what} ({e}); multi-node runs need a shared "
                                  f"filesystem with flock support for {self.key}") from e
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._lock_file = f

    def close(self) -> None:
        """Release the lock (idempotent)."""
        for other in self.others:
            other.close()
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clean(root: Path) -> None:
    """Remove ``step_N.tmp`` folders and ``latest.tmp`` left by crashed saves; put back a
    ``step_N.old`` whose replacement never arrived (delete it when ``step_N`` exists)."""
    for p in root.iterdir():
        base = root / p.name.rsplit(".", 1)[0]
        if p.name == "latest.tmp":
            p.unlink()
        elif p.is_dir() and p.suffix == ".tmp" and _step_of(base) is not None:
            shutil.rmtree(p)
        elif p.is_dir() and p.suffix == ".old" and _step_of(base) is not None:
            if base.exists():
                shutil.rmtree(p)
            else:
                os.replace(p, base)
    _fsync(root)


def open_checkpoint_dir(root: str | Path, is_first: bool, out_dir: str | Path | None = None) -> CheckpointDir:
    """Claim ``root`` for this job; call on every rank at start-up (a collective when distributed).
    The first rank (global rank 0) creates ``root``, takes an exclusive ``flock`` on ``root/.lock``
    held until :meth:`CheckpointDir.close`, and cleans up after crashed saves (:func:`_clean`). If
    another job holds the lock, every rank raises :class:`CheckpointInUse` naming it (host, pid).
    ``out_dir`` (the run's metrics and logs) is claimed the same way, on ``out_dir/.out.lock``."""
    handle, error = CheckpointDir(Path(root)), None
    if is_first:
        try:
            handle.lock()
            _clean(handle.root)
            if out_dir is not None:
                handle.others.append(CheckpointDir(Path(out_dir), OUT_LOCK, "out_dir"))
                handle.others[-1].lock()
        except Exception as e:  # reported on every rank below, so no rank waits in a collective
            handle.close()
            error = e
    if world_group() is not None:
        messages = all_gather_object(None if error is None else str(error), world_group())
        failed = next((m for m in messages if m is not None), None)
        if failed is not None and error is None:
            handle.close()
            raise CheckpointInUse(failed)
    if error is not None:
        raise error
    return handle
