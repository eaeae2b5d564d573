"""Resuming a run: the newest checkpoint that is intact and this run's, falling back past damage.

A damaged or unreadable checkpoint (:class:`CheckpointCorrupt`: a checksum mismatch, a file that
cannot be parsed) is skipped with one line in the run's log naming the file, for the previous
complete one; a checkpoint of another model or data (:class:`CheckpointMismatch`) is refused, never
skipped, so a run never trains over the wrong checkpoint and keep-N never prunes the right ones.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointCorrupt
from .files import resume_order, to_stderr
from .save_load import load_checkpoint


def resume_latest(root: str | Path, model, optimizer, streams, *, config, data: dict | None = None,
                  log: Callable[[str], None] = to_stderr) -> tuple[Path, dict] | None:
    """Load the newest usable checkpoint under ``root`` (every rank; the arguments as
    :func:`load_checkpoint`'s, ``config.checkpoint.verify`` deciding the checksum check) and return
    ``(folder, extra)``; ``None`` when ``root`` holds no complete checkpoint. Raises
    :class:`CheckpointCorrupt` when every complete checkpoint is damaged. ``log`` (the run's log:
    rank 0's print) gets one line per checkpoint skipped and per RNG-device change on load."""
    complete, skipped = resume_order(root)
    for why in skipped:
        log(f"{why} and was skipped; using {complete[0] if complete else 'no checkpoint'}")
    first = None
    for i, folder in enumerate(complete):
        try:
            return folder, load_checkpoint(folder, model, optimizer, streams, config=config, data=data,
                                           verify=config.checkpoint.verify, log=log)
        except CheckpointCorrupt as e:
            first = first or e
            then = f"resuming from {complete[i + 1]} instead" if i + 1 < len(complete) else "no other checkpoint"
            log(f"{e}; {then}")
    if first is not None:
        raise CheckpointCorrupt(f"no checkpoint under {root} is intact: {first}")
    return None


__all__ = ["resume_latest"]
