"""seqpar's own GPT in one layout: the run config for the layout, its mesh, the Trainer's step engine.

The model, the recipe (TP/SP -> CP -> recompute -> compile -> FSDP2/DDP, or pipeline stages) and
the step (micro-batches, gradient reductions, global-norm clip) are the ones ``seqpar train``
runs: :func:`~seqpar.parallel.engine.build_engine` on the config :func:`layout_config` writes.
"""
from __future__ import annotations

import dataclasses

import torch

from ...config import RunConfig
from ...distributed.mesh import ParallelMesh, init_parallel
from ...parallel.engine import build_engine
from ...parallel.precision import Precision
from ...train.resolve import ResolvedRun, resolve_run
from .layouts import Layout
from .steps import GLOBAL_BATCH, MICRO_BATCH, global_batch, rank_batches


def layout_config(run: RunConfig, lay: Layout, *, dtype: str, dropout: float, seed: int) -> RunConfig:
    """``run`` set to ``lay`` (sizes, SP, K/V exchange, ddp/fsdp, recompute, compile) with
    ``dtype`` parameters, dropout ``dropout`` (attention dropout too, except under cp, which
    refuses it) and the verify batch (:data:`GLOBAL_BATCH` sequences per step, fp32 recipe)."""
    m = dataclasses.replace(run.model, dtype=dtype, sequence_parallel=lay.sp, recompute=lay.recompute,
                            recompute_layers=None, dropout=dropout, attention_dropout=dropout if lay.cp == 1 else 0.0)
    p = dataclasses.replace(run.parallel, tp=lay.tp, cp=lay.cp, cp_comm=lay.cp_comm, pp=lay.pp, dp=lay.dp,
                            data_parallel=lay.dp_mode if lay.dp > 1 else None, virtual_stages=1, pp_schedule=None,
                            tp_overlap=False)
    t = dataclasses.replace(run.train, micro_batch=max(1, min(MICRO_BATCH, GLOBAL_BATCH // lay.dp)),
                            global_batch=GLOBAL_BATCH, precision="fp32", compile=lay.compile, seed=seed,
                            memory_check=False)
    return dataclasses.replace(run, model=m, parallel=p, train=t)


def resolve_layout(run: RunConfig, lay: Layout, **kw) -> ResolvedRun:
    """The layout's resolved run; raises the config's own :class:`UserError` where it does not apply."""
    return resolve_run(layout_config(run, lay, **kw), lay.world)


def layout_mesh(lay: Layout) -> ParallelMesh:
    """This rank's mesh for ``lay`` (the one-process run: a mesh without groups)."""
    if lay.world == 1:
        return ParallelMesh.single()
    return init_parallel(tp=lay.tp, dp=lay.dp, pp=lay.pp, cp=lay.cp)


class GPTRun:
    """The engine of one layout, with the calls :func:`~.steps.train_steps` makes."""

    def __init__(self, run: RunConfig, lay: Layout, *, dtype: str, dropout: float, seed: int):
        self.lay, self.seed = lay, seed
        self.resolved = resolve_layout(run, lay, dtype=dtype, dropout=dropout, seed=seed)
        self.mesh = layout_mesh(lay)
        cfg = self.resolved.cfg
        precision = Precision("fp32", self.mesh.device, fsdp=self.resolved.dp_mode == "fsdp")
        self.engine = build_engine(cfg, self.mesh, accum=self.resolved.accum, precision=precision, probe=False)
        self.parts = list(self.engine.parts)
        self.module = self.engine.module
        self.vocab, self.seq_len = cfg.model.vocab_size, cfg.model.seq_len

    @property
    def tp_group(self):
        return self.mesh.tp_group

    def batches(self, step: int) -> list:
        tokens, labels = global_batch(self.vocab, self.seq_len, step, self.seed)
        return rank_batches(tokens, labels, self.mesh.dp_rank, self.mesh.dp_size, self.resolved.cfg.train.micro_batch)

    def forward_backward(self, batches: list) -> torch.Tensor:
        return self.engine.forward_backward(batches)

    def clip(self) -> torch.Tensor:
        return self.engine.clip(0.0)


__all__ = ["GPTRun", "layout_config", "layout_mesh", "resolve_layout"]
