"""``seqpar memory CONFIG --cp N``: per-rank activation bytes with context parallelism.

One row per recompute mode: what one rank keeps for backward for one micro-batch of the whole
model (:func:`seqpar.memory.whole_model.model_activation_bytes`, 16-bit activations) at cp = 1
and at cp = N, and their ratio. Under cp every term is one CP rank's ``s/cp`` tokens and the
context-parallel attention kernel keeps no ``s x s`` term in any mode (only its log-sum-exp).
"""
from __future__ import annotations

import dataclasses

from ..distributed.context import check_context_layout
from ..memory.whole_model import model_activation_bytes
from ..memory.units import human
from ..model.config import GPTConfig
from ..model.modes import RECOMPUTE_MODES


def cp_table(model: GPTConfig, *, t: int, micro_batch: int, cp: int, name: str = "") -> str:
    """A Markdown table of per-rank activation bytes at cp = 1 and cp = ``cp``, per recompute mode.
    Raises :class:`~seqpar.errors.UserError` naming the values when ``model.seq_len`` does not cut
    into ``2*cp`` chunks."""
    check_context_layout(model.seq_len, cp, t, model.sequence_parallel)
    rows = [f"{name} activations per rank with context parallelism: t={t}, b={micro_batch}, s={model.seq_len} "
            f"(s/cp={model.seq_len // cp} per CP rank), 16-bit activations",
            "", "| recompute | cp=1 | " + f"cp={cp} | ratio |", "|---|---:|---:|---:|"]
    for mode in RECOMPUTE_MODES:
        cfg = dataclasses.replace(model, recompute=mode, recompute_layers=None)
        one, many = (model_activation_bytes(cfg, t=t, micro_batch=micro_batch, cp=c)["total"] for c in (1, cp))
        rows.append(f"| {mode} | {human(one)} | {human(many)} | {many / one:.3f} |")
    return "\n".join(rows)


__all__ = ["cp_table"]
