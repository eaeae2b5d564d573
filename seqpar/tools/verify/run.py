"""The orchestrator: resolve TARGET, run the one-process reference, then each world size's layouts
on local CPU gloo ranks (:func:`~seqpar.distributed.local.run_local`), and collect the report.
:func:`assert_layouts_equal` is the same check for a test suite."""
from __future__ import annotations

import importlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from ...distributed.local import RankFailed, run_local
from ...errors import UserError
from .compare import TOLERANCE, Row
from .dropin_run import dropin_skip_reason
from .layouts import Layout, parse_layout, parse_layouts
from .ranks import Options, rank_main, reference_main
from .report import Report
from .target import FUNCTION, Target, resolve_target

DEFAULT_BUDGET_S = 900.0
COLLECTIVE_TIMEOUT_S = 120.0


def _layouts(layouts: str | Sequence[str | Layout] | None) -> list[Layout]:
    if layouts is None or isinstance(layouts, str):
        return parse_layouts(layouts)
    return [x if isinstance(x, Layout) else parse_layout(x) for x in layouts]


def skip_reason(target: Target, lay: Layout, opts: Options) -> str | None:
    """Why ``lay`` does not apply to ``target`` (known before any rank starts), or None."""
    if target.kind != "seqpar":
        return dropin_skip_reason(lay)
    from .gpt_run import resolve_layout
    try:
        resolve_layout(target.run, lay, dtype=opts.dtype, dropout=0.0, seed=opts.seed)
    except (UserError, ValueError) as e:
        return str(e).splitlines()[0]
    return None


def preload_transformers() -> None:
    """Ranks fork from a server that imported these once (if it has not started yet), instead of
    every rank importing transformers on its own (seconds each on a shared CPU)."""
    from ...distributed import local
    for name in ("transformers", "transformers.models.llama.modeling_llama", "transformers.models.gpt2.modeling_gpt2"):
        if name not in local.PRELOAD:
            local.PRELOAD.append(name)


def _check_function(spec: str, what: str) -> None:
    """``module:function`` that imports and names a function (it is called only in the ranks)."""
    if not FUNCTION.match(spec):
        raise UserError(f"verify: {what} must be module:function, got {spec!r}")
    module, _, fn = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise UserError(f"verify: cannot load {what} {spec!r}: {e}") from None
    if not callable(found):
        raise UserError(f"verify: {what} {spec!r} is not a function")


def _error_rows(layouts: list[Layout], e: BaseException) -> list[Row]:
    first = str(e).splitlines()[0]
    return [Row(lay.name, "error", lay.world, reason=first, problems=[str(e)]) for lay in layouts]


def _check_args(dtype: str, steps: int, dropout: float | None, time_budget: float | None,
                setup: str | None) -> None:
    """Every argument's problem as a :class:`UserError`, before anything starts."""
    if dtype not in TOLERANCE:
        raise UserError(f"verify: dtype must be one of {sorted(TOLERANCE)}, got {dtype!r}")
    if not isinstance(steps, int) or steps < 1:
        raise UserError(f"verify: steps must be a positive integer, got {steps!r}")
    if dropout is not None and not 0.0 <= dropout < 1.0:
        raise UserError(f"verify: dropout must be in [0, 1), got {dropout!r}")
    if time_budget is not None and not time_budget >= 0:
        raise UserError(f"verify: the time budget must be >= 0 seconds (or None), got {time_budget!r}")
    if setup is not None:
        _check_function(setup, "setup")


def _run_layouts(tgt: Target, todo: list[Layout], opts: Options, time_budget: float | None) -> dict[str, Row]:
    """The reference, then one spawn of local ranks per world size; a row per layout of ``todo``."""
    spent = (lambda: opts.deadline is not None and time.time() >= opts.deadline)
    timeout = None if time_budget is None else 2 * time_budget
    rows: dict[str, Row] = {}
    try:
        ref = None if not todo or spent() else run_local(reference_main, 1, tgt, opts, timeout=timeout)[0]
    except (RankFailed, TimeoutError) as e:  # the one-process run itself fails: nothing to compare with
        return {row.layout: row for row in _error_rows(todo, e)}
    for world in sorted({lay.world for lay in todo}):
        group = [lay for lay in todo if lay.world == world]
        if ref is None or spent():  # no ranks started for layouts that could not begin anyway
            rows.update({lay.name: Row(lay.name, "not run", lay.world, reason="the time budget was spent before it "
                                       "started") for lay in group})
            continue
        try:
            got = run_local(rank_main, world, tgt, group, ref, opts, collective_timeout=COLLECTIVE_TIMEOUT_S,
                            timeout=timeout)[0]
        except (RankFailed, TimeoutError) as e:
            got = _error_rows(group, e)
        rows.update({row.layout: row for row in got})
    return rows


def verify(target: str | Target, layouts: str | Sequence[str | Layout] | None = None, *, dtype: str = "float64",
           steps: int = 2, time_budget: float | None = DEFAULT_BUDGET_S, masks: bool = True, progress: bool = True,
           shrink: bool = True, dropout: float | None = None, setup: str | None = None) -> Report:
    """Run ``target`` in each of ``layouts`` and in one process and compare them (docs/verify.md).
    ``dropout``: the mask probe's dropout (None: 0.1 for seqpar's GPT, a drop-in model's own).
    ``setup``: ``"module:function"`` that every rank calls before building anything (register
    custom ops, import plugins, or plant a bug in a test). ``time_budget``: seconds after which
    no layout starts (None: no limit). Raises :class:`UserError` for a bad target, layout name,
    dtype, step count, dropout, budget or setup."""
    _check_args(dtype, steps, dropout, time_budget, setup)
    lays = _layouts(layouts)
    start = time.monotonic()
    deadline = None if time_budget is None else time.time() + time_budget
    opts = Options(dtype=dtype, steps=steps, masks=masks, progress=progress, deadline=deadline, dropout=dropout,
                   setup=setup)
    tgt = target if isinstance(target, Target) else resolve_target(target, shrink=shrink,
                                                                  pp=max(lay.pp for lay in lays))
    if tgt.kind == "hf":
        preload_transformers()
    rows: dict[str, Row] = {}
    for lay in lays:
        reason = skip_reason(tgt, lay, opts)
        if reason:
            rows[lay.name] = Row(lay.name, "skipped", lay.world, reason=reason)
    rows.update(_run_layouts(tgt, [lay for lay in lays if lay.name not in rows], opts, time_budget))
    report = Report(tgt.name, tgt.kind, dtype, opts.tolerance, steps, rows=[rows[lay.name] for lay in lays])
    report.seconds = time.monotonic() - start
    return report


def assert_layouts_equal(build_model: Callable[[], Any] | str, plan: Any = None,
                         layouts: str | Sequence[str] | None = ("t2", "t2-nosp", "t2-selective"), *,
                         dtype: str = "float64", steps: int = 2, masks: bool = True,
                         time_budget: float | None = None, setup: str | None = None) -> Report:
    """For pytest: train ``build_model()`` (a module-level function, or ``"module:function"``;
    with ``plan`` it returns the model, without it ``(model, plan)`` or a
    :class:`~.target.UserModel`) in each layout and in one process; raise ``AssertionError``
    naming each layout, parameter and problem unless all agree. Returns the report."""
    name = build_model if isinstance(build_model, str) else f"{build_model.__module__}:{build_model.__qualname__}"
    target = Target("function", name, function=build_model, plan=plan)
    report = verify(target, layouts, dtype=dtype, steps=steps, masks=masks, progress=False, time_budget=time_budget,
                    setup=setup)
    if not report.passed:
        raise AssertionError("\n".join([report.verdict(), *report.problems()]))
    return report


__all__ = ["DEFAULT_BUDGET_S", "assert_layouts_equal", "skip_reason", "verify"]
