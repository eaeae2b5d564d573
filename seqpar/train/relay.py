"""What ``seqpar train --nproc-per-node N`` prints about its ranks (the ranks leave these lines to it).

- A user-input error: one line per distinct message, naming the ranks that saw it (none named with
  one rank), exit 2 -- read from the ``seqpar_user_error`` field each rank writes into torchrun's
  error file (:func:`seqpar.config.errors.report_user_error`).
- Any other failure: one line per failed rank with its exit code or signal, exit 1 (its traceback,
  if any, is above).
- ``--max-restarts``: when a rank dies and torchrun restarts the group, one line naming the rank,
  how it ended and the attempt, before the restarted ranks print where they resume.

torchrun's agent says nothing (its loggers are silenced); the restart line is built from the two
records its agent logs at that moment (:class:`RestartNotices`).
"""
from __future__ import annotations

import logging
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


# the records of torchrun's agent (torch 2.x) that RestartNotices reads
_FAILED_LOGGER = "torch.distributed.elastic.multiprocessing.api"  # "failed (exitcode: %s) local_rank: %s ..."
_RESTART_LOGGER = "torch.distributed.elastic.agent.server.api"    # "... %s/%s attempts left; will restart ..."


class RestartNotices(logging.Handler):
    """Prints ``seqpar train: rank R failed (signal SIGKILL); restarting all 2 ranks (restart 1 of 3)
    from the newest checkpoint`` when torchrun's agent restarts the group. Install with
    :meth:`install` around the agent's run (one node: local rank = global rank)."""

    def __init__(self, nproc: int):
        super().__init__(logging.INFO)
        self.nproc = nproc
        self.failed: tuple[int, int] | None = None  # (local rank, exit code) of the first failure
        self._saved: list[tuple[logging.Logger, int, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg, args = record.msg if isinstance(record.msg, str) else "", record.args
        if msg.startswith("failed (exitcode") and isinstance(args, tuple) and len(args) >= 2:
            self.failed = (int(args[1]), int(args[0]))
        elif "will restart worker group" in msg and isinstance(args, tuple) and len(args) == 4:
            left, total = int(args[2]), int(args[3])
            who = "a rank failed" if self.failed is None else \
                f"rank {self.failed[0]} failed ({how_it_ended(self.failed[1])})"
            ranks = "the rank" if self.nproc == 1 else f"all {self.nproc} ranks"
            _say(f"{who}; restarting {ranks} (restart {total - left + 1} of {total}) from the newest checkpoint")
            self.failed = None

    def install(self) -> "RestartNotices":
        """Route the two loggers' records here only (nothing of torchrun's reaches the terminal)."""
        for name in (_FAILED_LOGGER, _RESTART_LOGGER):
            log = logging.getLogger(name)
            self._saved.append((log, log.level, log.propagate))
            log.setLevel(logging.INFO)
            log.propagate = False
            log.addHandler(self)
        return self

    def remove(self) -> None:
        """Put the loggers back as they were."""
        for log, level, propagate in self._saved:
            log.removeHandler(self)
            log.setLevel(level)
            log.propagate = propagate
        self._saved.clear()
