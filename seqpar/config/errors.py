"""One error path for every ``seqpar`` entry point: a user-input error is one line and exit code 2.

What counts as user input: :class:`UserError` anywhere, and a ``ValueError``, ``OSError`` or
``pickle.UnpicklingError`` (with their subclasses: the config's ``ConfigError``, the checkpoint
package's errors, ``FileNotFoundError``, ``FileExistsError``, ...) raised by seqpar's own code, i.e.
where the innermost frame outside the standard library is in the ``seqpar`` package. The same
types raised inside torch, numpy or another library are internal failures and keep their
traceback, like every other exception.
"""
from __future__ import annotations

import os
import pickle
import sys
import sysconfig
import traceback
from pathlib import Path

EXIT_USER_ERROR = 2    # bad input: config, data, checkpoint, command-line arguments
EXIT_INTERRUPTED = 130  # aborted by a second Ctrl-C (128 + SIGINT)
USER_ERROR_KEY = "seqpar_user_error"  # in torchrun's error file: the message, without program and rank

_SEQPAR = str(Path(__file__).resolve().parents[1]) + os.sep
_STDLIB = tuple(str(Path(sysconfig.get_paths()[k]).resolve()) + os.sep for k in ("stdlib", "platstdlib"))
_USER_TYPES = (ValueError, OSError, pickle.UnpicklingError)


class UserError(ValueError):
    """Bad input named by its value, key or file; printed as one line by the entry points."""


def _raised_by_seqpar(exc: BaseException) -> bool:
    """Whether the innermost frame of ``exc``'s traceback outside the standard library is seqpar's."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if frame.filename.startswith("<frozen "):
            continue  # the standard library's frozen modules
        name = str(Path(frame.filename).resolve())
        if name.startswith(_SEQPAR):
            return True
        if not name.startswith(_STDLIB) or "site-packages" in name:
            return False
    return False


def is_user_error(exc: BaseException) -> bool:
    """True for bad input (see the module docstring): print one line, exit 2."""
    if isinstance(exc, UserError):
        return True
    return isinstance(exc, _USER_TYPES) and _raised_by_seqpar(exc)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (an ``OSError`` without its own text names its file)."""
    text = str(exc)
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{text}: {exc.filename}"
    if not isinstance(exc, (UserError, ValueError)) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return " ".join(text.split())


def rank_prefix() -> str:
    """``"rank R: "`` under torchrun with several ranks, else empty."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return f"rank {os.environ['RANK']}: "
    return ""


def report_user_error(prog: str, exc: BaseException, *, quiet: bool = False) -> int:
    """Print ``prog: [rank R: ]message`` to stderr (unless ``quiet``) and hand the line to torchrun's
    error file when there is one (plain torchrun shows ``"message"`` in its summary; ``seqpar train
    --nproc-per-node`` prints :data:`USER_ERROR_KEY`'s text once, for one rank or many). Returns
    :data:`EXIT_USER_ERROR`.

    Under torchrun the first rank to exit makes the agent SIGTERM the others; a rank that has
    reported its error ignores that signal from then on, so it finishes shutting down and exits 2,
    not -15 (torchrun still SIGKILLs a rank that does not exit within its grace period)."""
    text = one_line(exc)
    line = f"{prog}: {rank_prefix()}{text}"
    if not quiet:
        print(line, file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        import json
        import signal
        import time
        try:
            Path(error_file).write_text(json.dumps({"message": line, USER_ERROR_KEY: text,
                                                   "timestamp": int(time.time())}))
        except OSError:
            pass
        # ignored, not handled: a Python handler is reset during interpreter shutdown, SIG_IGN is kept
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return EXIT_USER_ERROR


def run_entry_point(prog: str, main, argv: list[str] | None = None, *, quiet: bool = False) -> int:
    """``main(argv)`` with the one error path: user errors -> one line, exit 2; a KeyboardInterrupt
    that got through (a second Ctrl-C) -> one line, exit 130; anything else propagates."""
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: {rank_prefix()}interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except BaseException as exc:
        if not is_user_error(exc):
            raise
        return report_user_error(prog, exc, quiet=quiet)
