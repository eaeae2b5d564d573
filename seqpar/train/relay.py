"""What ``seqpar train --nproc-per-node N`` prints about its ranks (the ranks leave these lines to it).

- A user-input error: one line per distinct message, naming the ranks that saw it (none named with
  one rank), exit 2 -- read from the ``seqpar_user_error`` field each rank writes into torchrun's
  error file (:func:`seqpar.config.errors.report_user_error`).
- Any other failure: one line per failed rank with its exit code or signal, exit 1 (its traceback,
  if any, is above).

torchrun's agent says nothing (its loggers are silenced).
"""
from __future__ import annotations

import signal
import sys

from ..config.errors import USER_ERROR_KEY

PROG = "seqpar train"


def _say(line: str) -> None:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def how_it_ended(exitcode: int) -> str:
    """``"exit code 3"`` or ``"signal SIGKILL"`` (torchrun's exit codes: minus the signal number)."""
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def report_failures(failures: dict, nproc: int) -> int:
    """Print the lines for torchrun's ``{global rank: ProcessFailure}`` of a failed run of ``nproc``
    ranks; returns the command's exit code (2: user errors, else 1)."""
    user: dict[str, list[int]] = {}
    for rank, f in sorted(failures.items()):
        text = f.error_file_data.get(USER_ERROR_KEY) if f.exitcode == 2 else None
        if isinstance(text, str):
            user.setdefault(text, []).append(rank)
    for text, ranks in user.items():
        who = "" if nproc == 1 else f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}: "
        _say(f"{who}{text}")
    if user:
        return 2
    for rank, f in sorted(failures.items()):
        _say(f"rank {rank} failed ({how_it_ended(f.exitcode)})")
    return 1
