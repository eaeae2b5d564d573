"""Bad input, as one family of exceptions: :class:`UserError`.

The command line prints a ``UserError`` as one line and exits 2
(:func:`seqpar.config.errors.run_entry_point`); any other exception is a bug or a failure of the
machine and keeps its traceback. The exception's type decides, not the module that raised it: a
``ValueError`` from a broken invariant inside seqpar is a bug. Bad input is raised as a
``UserError`` (or one of its domain kinds: ``ConfigError``, ``DataError``, ``CheckpointError``,
``NonFiniteError``) where the value or the file name comes from the user; an ``OSError`` met on a
path the user named is turned into one there (:func:`file_error`). ``UserError`` is a
``ValueError``, so ``except ValueError`` still catches it.

This module imports nothing of seqpar: every package may raise these.
"""
from __future__ import annotations

import errno
import os


class UserError(ValueError):
    """Bad input named by its value, key or file: a config value, a command-line argument, a file
    or folder the user named, what a checkpoint or a data file holds."""


class MissingFile(UserError, FileNotFoundError):
    """A file or folder the user named that does not exist (also a ``FileNotFoundError``)."""


def file_error(what: str, err: OSError) -> UserError:
    """The one-line error for ``err``, met opening, reading or writing ``what`` (a path the user
    named, with its role: ``"out_dir 'runs'"``): ``"out_dir 'runs': Permission denied"``, naming
    the file too when it is another one (``(runs/metrics.jsonl)``). A missing path gives a
    :class:`MissingFile`. Raise it ``from err``."""
    reason = err.strerror or (os.strerror(err.errno) if err.errno else str(err)) or type(err).__name__
    if err.filename is not None and str(err.filename) not in what:
        reason += f" ({err.filename})"
    cls = MissingFile if err.errno == errno.ENOENT or isinstance(err, FileNotFoundError) else UserError
    return cls(f"{what}: {reason}")


__all__ = ["MissingFile", "UserError", "file_error"]
