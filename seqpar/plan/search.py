"""Enumerate the layouts of a model on N GPUs, keep those that fit, rank them by predicted step time.

The space: t dividing the GPUs of a node (TP stays on NVLink); p dividing the layers with t x p
dividing N; context parallelism cp where the sequence cuts into 2 cp chunks (the ring's K/V
exchange without pipeline stages, the all-gather's with them); dp = N / (t p cp); interleaving m
dividing the layers of a stage (p > 1, micro-batches a multiple of p); micro-batch b dividing the
batch per data-parallel rank; SP on or off (t > 1); DDP, or FSDP over dp x cp > 1 (p = 1); for an
MoE model without pipeline stages, ep dividing dp x cp and the experts;
recompute none, selective, full (uniform, N = 1), and the per-layer mix with
the fewest recomputed FLOPs that fits (:func:`seqpar.plan.recompute.best_mix`) when asked for, with
the ``model.recompute_ops`` choices of ``SearchSpace.recompute_ops`` (:func:`~seqpar.plan.recompute.best_choice`).
A mix is never faster than no recompute, so it is only searched where no recompute does not fit
and could still reach the top ``k``.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Iterator

from ..errors import UserError
from ..model.config import GPTConfig
from ..model.modes import DATA_PARALLEL_MODES, RECOMPUTE_MODES
from .gpus import GPU
from .layout import Layout, Recompute, check_layout
from .memory import HEADROOM, Memory, memory_per_gpu
from .recompute import allowed_ops, best_choice
from .timing import StepTime, step_time

UNIFORM = RECOMPUTE_MODES


@dataclass(frozen=True)
class Candidate:
    """A layout with its predicted memory and step time."""

    layout: Layout
    memory: Memory
    time: StepTime


@dataclass(frozen=True)
class SearchSpace:
    """Which values each dimension may take (``None``: everything that divides)."""

    tp: tuple[int, ...] | None = None
    sequence_parallel: tuple[bool, ...] = (True, False)
    recompute: tuple[str, ...] = UNIFORM  # add "mixed" for per-layer mixes
    data_parallel: tuple[str, ...] = DATA_PARALLEL_MODES
    cp: tuple[int, ...] | None = None  # context parallelism; None: every cp the sequence splits into
    ep: tuple[int, ...] | None = None  # expert parallelism (MoE); None: every ep dividing dp x cp and the experts
    # model.recompute_ops choices a "mixed" search may add to its none / selective layers (any subset)
    recompute_ops: tuple[str, ...] = ()


# The paper's own choices (Table 3 / Table 5): t = 8, one node's GPUs, for every model; p, m, b, SP
# and uniform recompute free; plain data parallelism.
PAPER_SPACE = SearchSpace(tp=(8,), recompute=UNIFORM, data_parallel=("ddp",), cp=(1,))


@dataclass(frozen=True)
class Problem:
    """What is being planned: the model, the cluster and the step."""

    model: GPTConfig
    gpus: int
    gpu: GPU
    global_batch: int
    gpus_per_node: int = 8
    precision: str = "bf16"
    headroom: float = HEADROOM  # fraction of each GPU's memory a layout must leave free

    def __post_init__(self) -> None:
        bad = {k: getattr(self, k) for k in ("gpus", "global_batch", "gpus_per_node")
               if not isinstance(getattr(self, k), int) or getattr(self, k) < 1}
        if bad:
            raise UserError(f"need positive integers, got {bad}")
        if not 0 <= self.headroom < 1:
            raise UserError(f"headroom must be a fraction in [0, 1), got {self.headroom}")

    @property
    def budget(self) -> float:
        """Bytes per GPU a layout may use: the GPU's memory less the headroom."""
        return self.gpu.hbm_bytes * (1 - self.headroom)


def evaluate(problem: Problem, layout: Layout, checked: bool = False) -> Candidate:
    """Memory and step time of one layout; ``UserError`` naming the values if it cannot run at all
    (``checked``: the caller has run :func:`~seqpar.plan.layout.check_layout` already)."""
    pr = problem
    if not checked:
        check_layout(layout, pr.model, pr.gpus, pr.global_batch, pr.gpus_per_node)
    memory = memory_per_gpu(pr.model, layout, pr.gpu.hbm_bytes, pr.global_batch, pr.precision,
                            headroom=pr.gpu.hbm_bytes - pr.budget)
    time = step_time(pr.model, layout, pr.gpu, pr.global_batch, pr.gpus_per_node, pr.precision)
    return Candidate(layout, memory, time)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _splits(problem: Problem, space: SearchSpace) -> Iterator[tuple[int, int, int, int]]:
    """``(t, p, cp, dp)`` with ``t`` dividing a node, ``p`` the layers, ``t p cp dp`` the GPUs
    (cp > 1 where the sequence cuts into ``2 cp`` chunks)."""
    pr, L = problem, problem.model.layers
    for t in (t for t in space.tp or _divisors(pr.gpus_per_node) if pr.gpus_per_node % t == 0):
        for p in (p for p in _divisors(L) if pr.gpus % (t * p) == 0):
            for cp in (c for c in space.cp or _divisors(pr.gpus // (t * p)) if (pr.gpus // (t * p)) % c == 0):
                if cp > 1 and pr.model.seq_len % (2 * cp):
                    continue
                dp = pr.gpus // (t * p * cp)
                if pr.global_batch % dp == 0:
                    yield t, p, cp, dp


def _expert_splits(model: GPTConfig, space: SearchSpace, ranks: int, pp: int) -> list[int]:
    """The ep values to try: 1 for a dense model or with pipeline stages, else those dividing both
    the ``ranks`` of dp x cp and the experts."""
    if model.moe is None or pp > 1:
        return [1]
    return [e for e in space.ep or _divisors(ranks) if ranks % e == 0 and model.moe.experts % e == 0]


def families(problem: Problem, space: SearchSpace) -> Iterator[Layout]:
    """Every valid layout of ``space`` with recompute left at none (the caller varies it)."""
    pr, L = problem, problem.model.layers
    for t, p, cp, dp in _splits(problem, space):
        for m in (_divisors(L // p) if p > 1 else [1]):
            for b in _divisors(pr.global_batch // dp):
                for sp in (s for s in space.sequence_parallel if not s or t > 1):
                    for mode in (d for d in space.data_parallel if d == "ddp" or dp * cp > 1):
                        for ep in _expert_splits(pr.model, space, dp * cp, p):
                            layout = Layout(t, p, dp, m, b, sp, Recompute("none"), mode, cp, ep)
                            try:
                                check_layout(layout, pr.model, pr.gpus, pr.global_batch, pr.gpus_per_node)
                            except UserError:
                                continue
                            yield layout


@dataclass
class SearchResult:
    """The fitting candidates, fastest first (the top ``k`` are exact; mixes below them may be pruned)."""

    ranked: list[Candidate]
    evaluated: int
    rejected_memory: int


def search(problem: Problem, space: SearchSpace = SearchSpace(), k: int = 10) -> SearchResult:
    """Rank every fitting layout of ``space`` by predicted step time (see the module docstring)."""
    ranked: list[Candidate] = []
    times: list[float] = []
    evaluated = rejected = 0

    def add(c: Candidate) -> None:
        i = bisect.bisect(times, c.time.seconds)
        times.insert(i, c.time.seconds)
        ranked.insert(i, c)

    for family in families(problem, space):
        none_time = None
        for kind in (r for r in UNIFORM if r in space.recompute):
            c = evaluate(problem, replace(family, recompute=Recompute(kind)), checked=True)
            evaluated += 1
            if c.memory.fits:
                add(c)
            else:
                rejected += 1
            if kind == "none":
                none_time = c.time.seconds
                if c.memory.fits:  # nothing recomputes less, so nothing is faster
                    break
        else:
            if "mixed" in space.recompute:
                kth = times[k - 1] if len(times) >= k else float("inf")
                if none_time is None or none_time < kth:  # a mix is never faster than no recompute
                    mix = best_choice(problem.model, family, problem.budget, problem.global_batch,
                                      problem.precision, allowed_ops(problem.model, space.recompute_ops))
                    if mix is not None and (mix.ops or sum(1 for _, n in mix.counts if n) > 1):
                        add(evaluate(problem, replace(family, recompute=mix)))
                        evaluated += 1
    return SearchResult(ranked, evaluated, rejected)
