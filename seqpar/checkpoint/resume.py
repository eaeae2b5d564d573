"""Resuming a run: the newest checkpoint that is intact and this run's, falling back past damage,
or the one ``checkpoint.resume=PATH`` names.

A damaged or unreadable checkpoint (:class:`CheckpointCorrupt`: a checksum mismatch, a file that
cannot be parsed) is skipped with one line in the run's log naming the file, for the previous
complete one; a checkpoint of another model or data (:class:`CheckpointMismatch`) is refused, never
skipped, so a run never trains over the wrong checkpoint and keep-N never prunes the right ones. A
checkpoint named by its path is never replaced by another: any problem with it is an error naming it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointCorrupt, CheckpointError
from .files import MARKER, _step_of, checkpoint_problem, latest_checkpoint, resume_order, to_stderr
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


def named_checkpoint(path: str | Path, log: Callable[[str], None] = to_stderr) -> Path:
    """The checkpoint folder ``checkpoint.resume=PATH`` names: ``PATH`` itself when it is a
    checkpoint folder (``step_N``, or any folder holding ``complete.json`` or ``extra.json``), else
    the newest complete checkpoint in the checkpoint dir ``PATH`` (``log`` naming incomplete ones it
    passes over, as :func:`~seqpar.checkpoint.files.latest_checkpoint`). Files only, no collective:
    every rank gets the same answer or the same :class:`CheckpointError`, naming ``PATH``."""
    path = Path(path)
    key = f"checkpoint.resume={path}"
    if not path.is_dir():
        raise CheckpointError(f"{key}: {'not a folder' if path.exists() else 'no such folder'}; name a "
                              f"checkpoint (step_N) folder or a checkpoint dir")
    if _step_of(path) is not None or (path / MARKER).exists() or (path / "extra.json").exists():
        problem = checkpoint_problem(path)
        if problem is not None:
            raise CheckpointCorrupt(f"{key}: not a complete checkpoint ({problem})")
        return path
    found = latest_checkpoint(path, log)
    if found is None:
        raise CheckpointError(f"{key}: holds no complete checkpoint (no step_N folder with its {MARKER})")
    return found


def resume_named(path: str | Path, model, optimizer, streams, *, config, data: dict | None = None,
                 log: Callable[[str], None] = to_stderr) -> tuple[Path, dict]:
    """Load the checkpoint ``checkpoint.resume=PATH`` names (:func:`named_checkpoint`; every rank)
    and return ``(folder, extra)``. No fallback: a damaged file or another model or data raises,
    naming it."""
    folder = named_checkpoint(path, log)
    return folder, load_checkpoint(folder, model, optimizer, streams, config=config, data=data,
                                   verify=config.checkpoint.verify, log=log)


def saved_global_batch(root: str | Path, *, folder: Path | None = None) -> int | None:
    """The global batch (sequences per optimizer step) the checkpoint a resume would load was
    trained with: ``data.global_batch`` of ``extra.json`` (plain JSON, nothing else read) of the
    first complete checkpoint under ``root`` whose ``extra.json`` holds one, in
    :func:`resume_latest`'s order; ``None`` when there is none or it is a step-0 checkpoint
    (``seqpar import``'s: nothing trained, so no batch to keep). No collective, no warning: every
    rank calls it before the run is resolved, and the resume itself reports what it skips."""
    for folder in [folder] if folder is not None else resume_order(root)[0]:
        try:
            extra = json.loads((folder / "extra.json").read_text())
        except (OSError, ValueError):
            continue
        data = extra.get("data") if isinstance(extra, dict) else None
        if not isinstance(data, dict):
            continue
        if data.get("step") == 0:  # nothing trained yet (seqpar import): no batch to keep
            return None
        batch = data.get("global_batch")
        if isinstance(batch, int) and not isinstance(batch, bool) and batch > 0:
            return batch
    return None


__all__ = ["named_checkpoint", "resume_latest", "resume_named", "saved_global_batch"]
