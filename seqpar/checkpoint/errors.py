"""What goes wrong with a checkpoint, as exceptions a command line prints in one line.

``CheckpointError`` (a :class:`~seqpar.errors.UserError`, so a ``ValueError``) is the base;
:class:`CheckpointCorrupt` means a file does not hold what was written (an automatic resume falls
back to the previous checkpoint),
:class:`CheckpointMismatch` that the checkpoint is intact but not this run's (never a fallback),
:class:`CheckpointWriteError` that a save could not write a file (a full disk, most often).
"""
from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

from ..errors import UserError


class CheckpointError(UserError):
    """A checkpoint that cannot be saved or used; the message names the folder or file."""


class CheckpointCorrupt(CheckpointError):
    """A file of a checkpoint is missing, of another size or checksum, or unreadable."""


class UnsafeCheckpoint(CheckpointCorrupt, pickle.UnpicklingError):
    """Checkpoint metadata that would run code or touch classes when unpickled."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint of another model or data than this run's."""


class CheckpointWriteError(CheckpointError):
    """A save that could not write one of its files."""


class IncompleteTrainingState(RuntimeError):
    """A save whose entries would not cover every parameter (a bug, not bad input: it keeps its
    traceback). Raised on every rank before any file is written, so no incomplete checkpoint is
    ever marked complete."""


class CheckpointInUse(CheckpointError, RuntimeError):
    """A checkpoint dir another job holds (or one that cannot be locked at all)."""


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


_SHORT_WRITE = "unexpected pos"  # torch's zip writer when the file took fewer bytes than it was given
_LOW_SPACE = 64 << 20


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
        except OSError:
            continue
    return None


def write_error(e: BaseException, path: str | Path) -> CheckpointWriteError | None:
    """The one-line error for ``e`` raised while writing ``path``: "no space left on device" for
    ENOSPC / EDQUOT, or for torch's short-write ``RuntimeError`` on a nearly full filesystem; any
    other ``OSError`` by its own text. ``None`` when ``e`` is not a write failure."""
    path = Path(path)
    for x in _chain(e):
        if isinstance(x, CheckpointWriteError):
            return x
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return CheckpointWriteError(f"no space left on device writing {path} ({os.strerror(x.errno)}); free "
                                        f"space in {path.parent.parent} or point checkpoint.dir elsewhere")
    for x in _chain(e):
        if isinstance(x, RuntimeError) and _SHORT_WRITE in str(x):
            free = _free_bytes(path.parent)
            if free is not None and free < _LOW_SPACE:
                return CheckpointWriteError(f"no space left on device writing {path} (a short write with "
                                            f"{free} bytes free); free space in {path.parent.parent} or point "
                                            f"checkpoint.dir elsewhere")
            return CheckpointWriteError(f"short write to {path} ({str(x).strip()[:160]})")
        if isinstance(x, OSError):
            return CheckpointWriteError(f"cannot write {path}: {x.strerror or x}")
    return None


__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointInUse", "CheckpointMismatch", "CheckpointWriteError", "UnsafeCheckpoint",
           "write_error"]
