"""One error path for every ``seqpar`` entry point: a user-input error is one line and exit code 2.

User input is decided by the exception's type: a :class:`~seqpar.errors.UserError` (the config's
``ConfigError``, the data's ``DataError``, the checkpoint package's errors, ``NonFiniteError``, ...)
wherever it is raised. Every other exception, a ``ValueError`` or ``OSError`` raised by seqpar's
own code included, is a bug or a failure of the machine and keeps its traceback. Code that meets
bad input raises a ``UserError`` there, where the value or file name is the user's
(:mod:`seqpar.errors`).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..errors import UserError

EXIT_USER_ERROR = 2    # bad input: config, data, checkpoint, command-line arguments
EXIT_INTERRUPTED = 130  # aborted by a second Ctrl-C (128 + SIGINT)
USER_ERROR_KEY = "seqpar_user_error"  # in torchrun's error file: the message, without program and rank


def is_user_error(exc: BaseException) -> bool:
    """True for bad input, a :class:`UserError`: print one line, exit 2."""
    return isinstance(exc, UserError)


def one_line(exc: BaseException) -> str:
    """The message of ``exc`` on one line (its type's name when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__


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
    """``main(argv)`` with the one error path: a :class:`UserError` -> one line, exit 2; a
    KeyboardInterrupt that got through (a second Ctrl-C) -> one line, exit 130; anything else
    propagates with its traceback."""
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: {rank_prefix()}interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except UserError as exc:
        return report_user_error(prog, exc, quiet=quiet)
