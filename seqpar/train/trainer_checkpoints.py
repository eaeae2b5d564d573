"""The Trainer's checkpoint methods: save (synchronous or in the background), resume, and what they hold."""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import dump
from ..checkpoint import data_identity, resume_latest, save_checkpoint
from .faults import check_finite_weights


class TrainerCheckpoints:
    """Mixed into :class:`seqpar.train.Trainer`, whose attributes (``cfg``, ``model``, ``optimizer``,
    ``pipeline``, ``batches``, ``mesh``, ``logger``, ...) it reads."""

    def save(self, step: int) -> Path:
        """Checkpoint the model, optimizer, RNG streams and data position as step ``step``; every rank.
        Each rank writes only its own shards. Under ``checkpoint.async`` the files are written in
        the background and sealed by the next save or :meth:`close`; the folder is returned."""
        check_finite_weights(self.model, step)  # every rank, before any rank starts writing
        ck = self.cfg.checkpoint
        self.finish_pending_save()
        extra = {"data": self.batches.state_dict(), "tp": self.mesh.tp_size, "dp": self.dp,
                 "pp": self.mesh.pp_size, "virtual_stages": self.cfg.parallel.virtual_stages,
                 "data_parallel": self.dp_mode,
                 "data_identity": data_identity(self.corpus.tokens, self.corpus.tokenizer)}
        out = save_checkpoint(ck.dir, step, self._parts, self.optimizer, extra, dump(self.cfg), self._streams,
                              keep=ck.keep, attachments=self.attachments, async_save=ck.async_save)
        if ck.async_save:
            self._pending, path = out, out.final
            self.logger.print(f"checkpoint started in the background: {path}")
        else:
            path = out
            self.logger.print(f"checkpoint saved: {path}")
        self.history["checkpoint"] = str(path)
        return path

    @property
    def _parts(self) -> list[torch.nn.Module]:
        """The modules whose parameters checkpoints hold: the GPT, or this rank's pipeline stages."""
        return list(self.pipeline.parts) if self.pipeline is not None else [self.model]

    @property
    def _streams(self) -> list:
        return self.pipeline.streams if self.pipeline is not None else [self.model.rng]

    def finish_pending_save(self) -> None:
        """Wait for a background checkpoint (``checkpoint.async``) and seal it; every rank."""
        pending, self._pending = getattr(self, "_pending", None), None
        if pending is not None:
            self.logger.print(f"checkpoint saved: {pending.finish()}")

    def resume(self) -> int:
        """Load the newest intact checkpoint of this model and data when ``checkpoint.resume`` is
        ``"auto"`` (any layout; :func:`~seqpar.checkpoint.resume_latest`); returns the step to start
        from (0 when there is none)."""
        ck = self.cfg.checkpoint
        found = resume_latest(ck.dir, self._parts, self.optimizer, self._streams, config=self.cfg,
                              data=data_identity(self.corpus.tokens, self.corpus.tokenizer)
                              ) if ck.resume == "auto" else None
        if found is None:
            return self.start_step
        latest, extra = found
        self.start_step = int(extra["step"])
        self.batches.load_state_dict(extra["data"])
        self.logger.print(f"resumed from {latest} at step {self.start_step}")
        return self.start_step
