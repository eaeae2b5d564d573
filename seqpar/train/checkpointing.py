"""The Trainer's checkpoints: save (synchronous or in the background) and resume, as a component.

A :class:`CheckpointManager` is given what a checkpoint holds -- the model parts and their RNG
streams (the GPT, or this rank's pipeline stages), the optimizer, the data stream's position,
the resolved run -- and writes and reads them through :mod:`seqpar.checkpoint`'s public functions.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn as nn

from ..checkpoint import resume_latest, save_checkpoint
from ..config import dump
from .faults import check_finite_weights
from .resolve import ResolvedRun


class CheckpointManager:
    """Save and resume one run's state on every rank. ``parts``/``streams``: the model parts and
    their RNG streams; ``module``: all parameters (the finite-weights check); ``batches``: the
    training stream (``state_dict``/``load_dict`` of its position); ``attachments``: files saved
    beside the weights (the tokenizer); ``data``: the training data's identity
    (:func:`seqpar.checkpoint.data_identity`), recorded and compared on resume; ``print``: rank 0's log."""

    def __init__(self, run: ResolvedRun, *, module: nn.Module, parts: Sequence[nn.Module], streams: Sequence,
                 optimizer: torch.optim.Optimizer, batches, attachments, data: dict, print: Callable[[str], None]):
        self.run, self.module, self.parts, self.streams = run, module, list(parts), list(streams)
        self.optimizer, self.batches, self.attachments, self.data = optimizer, batches, attachments, data
        self.print = print
        self.pending = None  # a background save not sealed yet (checkpoint.async)

    def _extra(self) -> dict:
        run, pc = self.run, self.run.cfg.parallel
        return {"data": self.batches.state_dict(), "tp": pc.tp, "dp": run.dp, "pp": pc.pp, "cp": pc.cp,
                "virtual_stages": pc.virtual_stages, "data_parallel": run.dp_mode, "data_identity": self.data}

    def save(self, step: int) -> Path:
        """Checkpoint the model, optimizer, RNG streams and data position as step ``step``; every rank.
        Each rank writes only its own shards. Under ``checkpoint.async`` the files are written in
        the background and sealed by the next save or :meth:`finish_pending`; the folder is returned."""
        check_finite_weights(self.module, step)  # every rank, before any rank starts writing
        ck, cfg = self.run.cfg.checkpoint, self.run.cfg
        self.finish_pending()
        out = save_checkpoint(ck.dir, step, self.parts, self.optimizer, self._extra(), dump(cfg), self.streams,
                              keep=ck.keep, attachments=self.attachments, async_save=ck.async_save)
        if ck.async_save:
            self.pending, path = out, out.final
            self.print(f"checkpoint started in the background: {path}")
        else:
            path = out
            self.print(f"checkpoint saved: {path}")
        return path

    def finish_pending(self) -> None:
        """Wait for a background checkpoint (``checkpoint.async``) and seal it; every rank."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self.print(f"checkpoint saved: {pending.finish()}")

    def resume(self) -> int | None:
        """Load the newest intact checkpoint of this model and data when ``checkpoint.resume`` is
        ``"auto"`` (any layout; :func:`~seqpar.checkpoint.resume_latest` falls back past damaged ones
        and refuses a different model or data); returns its step, or None when there is none."""
        ck = self.run.cfg.checkpoint
        found = resume_latest(ck.dir, self.parts, self.optimizer, self.streams, config=self.run.cfg,
                              data=self.data, log=self.print) if ck.resume == "auto" else None
        if found is None:
            return None
        latest, extra = found
        self.batches.load_state_dict(extra["data"])
        self.print(f"resumed from {latest} at step {int(extra['step'])}")
        return int(extra["step"])


__all__ = ["CheckpointManager"]
