"""The Trainer's checkpoints: save (synchronous or in the background) and resume, as a component.

A :class:`CheckpointManager` is given what a checkpoint holds -- the model parts and their RNG
streams (the GPT, or this rank's pipeline stages), the optimizer, the data position,
the resolved run -- and writes and reads them through :mod:`seqpar.checkpoint`'s public functions.
It also remembers the last good checkpoint (the one resumed from, or the newest written after
steps without a skipped one), which keep-N never prunes: the one to roll back to.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint import (CheckpointError, CheckpointMismatch, named_checkpoint, resume_latest, resume_named,
                          save_checkpoint, saved_global_batch)
from ..config import RunConfig, dump
from .faults import check_finite_weights
from .resolve import ResolvedRun


def resume_global_batch(cfg: RunConfig) -> int | None:
    """The global batch of the checkpoint ``checkpoint.resume`` would continue (``None``: no
    resume, or no checkpoint); read on every rank before the run is resolved, so a resume at
    another dp keeps it (:func:`seqpar.train.resolve.keep_saved_batch`)."""
    ck = cfg.checkpoint
    if ck.resume == "never":
        return None
    if ck.resume == "auto":
        return saved_global_batch(ck.dir)
    try:
        folder = named_checkpoint(ck.resume, log=lambda line: None)  # the resume logs what it skips
    except CheckpointError:
        return None  # the resume itself refuses the path, naming it
    return saved_global_batch(folder.parent, folder=folder)


class CheckpointManager:
    """Save and resume one run's state on every rank. ``parts``/``streams``: the model parts and
    their RNG streams; ``module``: all parameters (the finite-weights check); ``batches``: the
    training batches (``state_dict``/``load_dict`` of its position); ``attachments``: files saved
    beside the weights (the tokenizer); ``data``: the training data's identity
    (:func:`seqpar.checkpoint.data_identity`), recorded and compared on resume; ``print``: rank 0's log."""

    def __init__(self, run: ResolvedRun, *, module: nn.Module, parts: Sequence[nn.Module], streams: Sequence,
                 optimizer: torch.optim.Optimizer, batches, attachments, data: dict, print: Callable[[str], None]):
        self.run, self.module, self.parts, self.streams = run, module, list(parts), list(streams)
        self.optimizer, self.batches, self.attachments, self.data = optimizer, batches, attachments, data
        self.print = print
        self.pending = None  # a background save not sealed yet (checkpoint.async)
        self.good: Path | None = None  # the last good checkpoint: never pruned, named when a run diverges

    def _extra(self) -> dict:
        run, pc = self.run, self.run.cfg.parallel
        return {"data": self.batches.state_dict(), "tp": pc.tp, "dp": run.dp, "pp": pc.pp, "cp": pc.cp,
                "virtual_stages": pc.virtual_stages, "data_parallel": run.dp_mode, "data_identity": self.data}

    def save(self, step: int, *, good: bool = True) -> Path:
        """Checkpoint the model, optimizer, RNG streams and data position as step ``step``; every rank.
        Each rank writes only its own shards. Under ``checkpoint.async`` the files are written in
        the background and sealed by the next save or :meth:`finish_pending`; the folder is returned.
        ``good``: no step was skipped since the previous checkpoint, so this one becomes :attr:`good`;
        otherwise keep-N spares the current :attr:`good` (at most ``checkpoint.keep + 1`` remain)."""
        check_finite_weights(self.module, step)  # every rank, before any rank starts writing
        ck, cfg = self.run.cfg.checkpoint, self.run.cfg
        self.finish_pending()
        out = save_checkpoint(ck.dir, step, self.parts, self.optimizer, self._extra(), dump(cfg), self.streams,
                              keep=ck.keep, attachments=self.attachments, async_save=ck.async_save,
                              pinned=None if good else self.good)
        if ck.async_save:
            self.pending, path = out, out.final
            self.print(f"checkpoint started in the background: {path}")
        else:
            path = out
            self.print(f"checkpoint saved: {path}")
        if good:
            self.good = path
        return path

    def finish_pending(self) -> None:
        """Wait for a background checkpoint (``checkpoint.async``) and seal it; every rank."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.print(f"checkpoint saved: {pending.finish()}")

    def resume(self) -> int | None:
        """Load a checkpoint as ``checkpoint.resume`` says (any layout): ``auto``, the newest intact
        one of this model and data in ``checkpoint.dir`` (:func:`~seqpar.checkpoint.resume_latest`
        falls back past damaged ones); ``never``, none; a path, that checkpoint folder or the newest
        of that dir, without fallback (:func:`~seqpar.checkpoint.resume_named`). A different model
        or data is refused. Returns its step, or None when nothing was loaded."""
        ck, cfg = self.run.cfg.checkpoint, self.run.cfg
        if ck.resume == "never":
            return None
        if ck.resume == "auto":
            found = resume_latest(ck.dir, self.parts, self.optimizer, self.streams, config=cfg, data=self.data,
                                  log=self.print)
        else:
            found = resume_named(ck.resume, self.parts, self.optimizer, self.streams, config=cfg, data=self.data,
                                 log=self.print)
        if found is None:
            return None
        latest, extra = found
        step = int(extra["step"])
        if step > cfg.train.steps:  # every rank read the same step: each raises, no collective follows
            raise CheckpointMismatch(f"train.steps={cfg.train.steps} is below the step of checkpoint {latest} "
                                     f"({step}): nothing would train; set train.steps above {step} to continue")
        self._check_batch(latest, extra)
        self.batches.load_state_dict(extra["data"])
        self.good = latest
        self.print(f"resumed from {latest} at step {int(extra['step'])}")
        return int(extra["step"])

    def _check_batch(self, folder: Path, extra: dict) -> None:
        """Refuse a checkpoint whose global batch the run was not resolved for (a run resolved
        without reading it, or a resume that fell back to an older checkpoint of another batch);
        a step-0 checkpoint (``seqpar import``) has trained nothing and has no batch to keep."""
        data = extra.get("data")
        saved = data.get("global_batch") if isinstance(data, dict) and data.get("step") != 0 else None
        run = self.run
        if not isinstance(saved, int) or saved in (run.global_batch, run.saved_global_batch):
            return
        if run.saved_global_batch is None:
            how = (f"resolve the run with resolve_run(..., saved_global_batch={saved}), as Trainer does given a "
                   f"RunConfig")
        else:
            how = f"it was resolved for the {run.saved_global_batch} of a newer checkpoint; start it again"
        raise CheckpointMismatch(f"checkpoint {folder} trained with a global batch of {saved} sequences, this run "
                                 f"trains {run.global_batch}: {how}")


__all__ = ["CheckpointManager", "resume_global_batch"]
