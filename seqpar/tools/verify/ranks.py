"""What each local rank of a ``seqpar verify`` spawn runs: the one-process reference, then the
layouts of one world size in sequence (one spawn per world size, not per layout).

Per layout every rank builds the model from the same seed, runs the steps (dropout off: each TP
rank draws its own masks by design, so no layout could reproduce one process's), turns its
gradients dense and sends its results to rank 0, which compares them with the reference, prints
the progress line and keeps the report row. Where masks matter (TP > 1, or recompute) a second
build runs one step with dropout on under :class:`~.masks.DropoutRecorder`. Rank 0 decides
whether the time budget allows the next layout and tells the others.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...errors import UserError
from .compare import TOLERANCE, Row, compare
from .layouts import Layout
from .masks import DropoutRecorder, replay_problems, tp_mask_problems
from .steps import StepsResult, train_steps
from .target import Target, load_function

ONE_PROCESS = Layout("one process")
PROBE_DROPOUT = 0.1  # seqpar's GPT: the probe's dropout and attention dropout


@dataclass(frozen=True)
class Options:
    """How to run: parameter dtype, steps, seed, mask probe, progress lines, the budget's end."""

    dtype: str = "float64"
    steps: int = 2
    seed: int = 1234
    masks: bool = True
    progress: bool = True
    deadline: float | None = None  # time.time() after which no layout starts
    setup: str | None = None       # "module:function" every rank calls first (plugins, instrumentation)
    dropout: float | None = None   # the mask probe's dropout; None: PROBE_DROPOUT for seqpar's GPT, the
    #                                drop-in model's own dropout otherwise

    def probe_dropout(self, target: Target) -> float | None:
        """The probe's dropout; None keeps a drop-in model's own."""
        if self.dropout is not None or target.kind != "seqpar":
            return self.dropout
        return PROBE_DROPOUT

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.dtype]


def make_run(target: Target, lay: Layout, opts: Options, dropout: float | None = 0.0):
    """The layout's run object (:class:`~.gpt_run.GPTRun` or :class:`~.dropin_run.DropinRun`) with
    every dropout at ``dropout`` (None: a drop-in model's own)."""
    if target.kind == "seqpar":
        from .gpt_run import GPTRun
        return GPTRun(target.run, lay, dtype=opts.dtype, dropout=dropout, seed=opts.seed)
    from .dropin_run import DropinRun
    return DropinRun(target, lay, dtype=opts.dtype, dropout=dropout, seed=opts.seed)


def world_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean of a scalar over the world (itself in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    x = x.detach().clone()
    dist.all_reduce(x)
    return x / dist.get_world_size()


def _setup(opts: Options) -> None:
    """Default dtype as the library expects, then the caller's ``setup`` function, if any."""
    torch.set_default_dtype(torch.float32)
    if opts.setup:
        load_function(opts.setup)()


def reference_main(rank: int, world: int, target: Target, opts: Options) -> StepsResult:
    """The one-process run (``world == 1``)."""
    _setup(opts)
    run = make_run(target, ONE_PROCESS, opts)
    return train_steps(run, run.batches, opts.steps, run.tp_group, world_mean)


def probes_masks(lay: Layout, opts: Options) -> bool:
    return opts.masks and not lay.compile and (lay.tp > 1 or lay.recompute != "none")


def mask_problems(target: Target, lay: Layout, opts: Options) -> list[str] | None:
    """One step with dropout on; on rank 0 the mask rules' violations (None: no dropout drawn)."""
    run = make_run(target, lay, opts, dropout=opts.probe_dropout(target))
    with DropoutRecorder(run.parts[0] if len(run.parts) == 1 else run.module) as rec:
        run.forward_backward(run.batches(0))
    gathered = _gather(rec.draws)
    if gathered is None:
        return None
    if not any(gathered):
        return None  # the model draws no dropout we can see
    out: list[str] = []
    for start in range(0, len(gathered), lay.tp):  # TP groups are consecutive ranks
        group = gathered[start:start + lay.tp]
        out += [f"ranks {start}-{start + lay.tp - 1}: {p}" for p in tp_mask_problems(group)]
    for rank, draws in enumerate(gathered):
        out += [f"rank {rank}: {p}" for p in replay_problems(draws)]
    return sorted(set(out), key=out.index)


def _gather(obj):
    """Every rank's ``obj`` on rank 0 (a list in rank order), None elsewhere."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _go_on(opts: Options) -> bool:
    """Rank 0's decision whether the next layout starts, the same on every rank."""
    flag = torch.tensor([1 if opts.deadline is None or time.time() < opts.deadline else 0])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(flag, src=0)
    return bool(flag.item())


def progress(row: Row, opts: Options) -> None:
    if not opts.progress:
        return
    detail = row.reason or (f"loss {row.loss_err:.1e}  grad {row.grad_err:.1e}  masks {row.masks}"
                            if row.loss_err is not None else "")
    print(f"verify: {row.layout:<16} {row.status:<7} {detail}  ({row.seconds or 0:.1f} s)", file=sys.stderr, flush=True)


def run_layout(target: Target, lay: Layout, ref: StepsResult, opts: Options) -> Row | None:
    """One layout on every rank; the row on rank 0. A configuration the layout cannot take
    (raised on every rank before any collective) makes the row "skipped"."""
    start = time.perf_counter()
    try:
        run = make_run(target, lay, opts)
    except (UserError, ValueError) as e:
        return Row(lay.name, "skipped", lay.world, reason=str(e).splitlines()[0]) if dist.get_rank() == 0 else None
    result = train_steps(run, run.batches, opts.steps, run.tp_group, world_mean)
    del run
    masks = mask_problems(target, lay, opts) if probes_masks(lay, opts) else None
    gathered = _gather(result)
    if gathered is None:
        return None
    row = compare(lay.name, lay.world, ref, gathered, opts.tolerance, masks)
    if masks is None:
        row.masks = "n/a"
    row.seconds = time.perf_counter() - start
    return row


def rank_main(rank: int, world: int, target: Target, layouts: list[Layout], ref: StepsResult,
              opts: Options) -> list[Row] | None:
    """The layouts of one world size, in sequence; rank 0 returns their rows."""
    _setup(opts)
    rows = []
    for lay in layouts:
        if not _go_on(opts):
            row = Row(lay.name, "not run", lay.world, reason="the time budget was spent before it started")
        else:
            row = run_layout(target, lay, ref, opts)
        if rank == 0:
            progress(row, opts)
            rows.append(row)
    return rows if rank == 0 else None


__all__ = ["ONE_PROCESS", "Options", "make_run", "rank_main", "reference_main", "run_layout"]
