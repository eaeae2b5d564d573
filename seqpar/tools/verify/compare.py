"""Compare one layout's run with the one-process run: the numbers of a report row.

Errors are relative: a loss or norm against its reference value, a gradient as ``max |g - ref|``
over the largest reference entry of that parameter (at least 1e-3 of the step's largest
gradient entry, so a parameter whose gradient is nearly zero does not divide by nothing). Every
rank's dense copy of a gradient is compared, so a replicated parameter whose copies drift apart
across TP (a missing all-reduce) is named by the rank holding the wrong one. Vocabulary rows a
layout pads must get exactly zero gradient and are then left out of the comparison.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .steps import StepsResult

TOLERANCE = {"float64": 1e-9, "float32": 2e-4}  # relative error allowed, per parameter dtype


@dataclass
class Row:
    """One layout's line in the report."""

    layout: str
    status: str                    # "ok" | "FAIL" | "skipped" | "error" | "not run"
    world: int = 0
    loss_err: float | None = None
    grad_err: float | None = None
    grad_param: str | None = None  # where the worst gradient error is ("name (rank r, step k)")
    norm_err: float | None = None
    masks: str = "-"               # "ok", "n/a", or how many mask problems
    seconds: float | None = None
    problems: list[str] = field(default_factory=list)
    reason: str | None = None      # why skipped / not run / error

    def to_json(self) -> dict:
        return asdict(self)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-30)


def _grad_errors(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor], problems: list[str],
                 where: str) -> dict[str, float]:
    """Relative error per parameter name of ``got`` against ``ref`` (padding rows checked, then cut)."""
    floor = 1e-3 * max((float(r.abs().max()) for r in ref.values() if r.numel()), default=1.0)
    out = {}
    for name, g in got.items():
        r = ref.get(name)
        if r is None:
            problems.append(f"{name}: a gradient the one-process model does not have ({where})")
            continue
        g = g.to(r.dtype)
        if g.shape != r.shape:
            if g.dim() == r.dim() and g.shape[1:] == r.shape[1:] and g.shape[0] > r.shape[0]:
                pad = float(g[r.shape[0]:].abs().max())
                if pad != 0.0:
                    problems.append(f"{name}: padded vocabulary rows {r.shape[0]}..{g.shape[0] - 1} got gradient "
                                    f"{pad:.2e} (the padding is not masked; {where})")
                g = g[:r.shape[0]]
            else:
                problems.append(f"{name}: gradient shape {list(g.shape)} != {list(r.shape)} ({where})")
                continue
        out[name] = float((g - r).abs().max()) / max(float(r.abs().max()), floor)
    return out


def compare(layout: str, world: int, ref: StepsResult, ranks: list[StepsResult], tol: float,
            masks: list[str] | None) -> Row:
    """The report row of ``layout`` from every rank's result (``masks``: mask problems, None = not probed)."""
    problems: list[str] = []
    got = ranks[0]
    loss_err = max(_rel(a, b) for a, b in zip(got.losses, ref.losses))
    norm_err = max(_rel(a, b) for a, b in zip(got.norms, ref.norms))
    worst, worst_at = 0.0, None
    for rank, res in enumerate(ranks):
        for step, (grads, ref_grads) in enumerate(zip(res.grads, ref.grads)):
            for name, err in _grad_errors(ref_grads, grads, problems, f"rank {rank}, step {step}").items():
                if err > worst or worst_at is None:
                    worst, worst_at = err, f"{name} (rank {rank}, step {step})"
    held = set().union(*(set(g) for res in ranks for g in res.grads)) if ranks[0].grads else set()
    for name in sorted(set(ref.grads[0]) - held) if ref.grads else []:
        problems.append(f"{name}: no rank holds a gradient for it")
    for rank, res in enumerate(ranks):
        problems += [f"{name}: no gradient on rank {rank}" for name in res.missing]
    first: list[str] = []  # the numbers first: the verdict quotes the first problem
    if worst > tol:
        first.append(f"gradient of {worst_at} differs from one process by {worst:.2e} (relative)")
    loss_tol = max(tol, TOLERANCE.get(ref.loss_dtype, tol))  # a loss computed in fp32 agrees to fp32's precision
    if loss_err > loss_tol:
        first.append(f"loss differs from one process by {loss_err:.2e} (relative; {ref.loss_dtype} loss)")
    if norm_err > tol:
        first.append(f"global gradient norm differs from one process by {norm_err:.2e} "
                     f"({got.norms} vs {ref.norms})")
    problems = first + problems
    problems += list(masks or [])
    mask_text = "n/a" if masks is None else ("ok" if not masks else f"{len(masks)} problem(s)")
    return Row(layout, "FAIL" if problems else "ok", world, loss_err, worst, worst_at, norm_err, mask_text,
               problems=problems)


__all__ = ["Row", "TOLERANCE", "compare"]
