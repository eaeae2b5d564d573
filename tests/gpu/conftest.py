"""The GPU checks as tests: the ``device`` fixture, rows with thresholds, the table at the end.

A check takes ``device`` and runs twice: ``[cpu]`` at tiny shapes in the normal suite (the same
code paths; timings shown, not asserted) and ``[cuda]`` at full size, marked ``gpu``: deselected
unless ``-m gpu`` asks for it (scripts/gpu_check.sh does), and then skipped without CUDA. A check
only a GPU can make takes ``cuda`` (the ``[cuda]`` variant alone).

A check records each measurement with ``record_row(check, measured, threshold, ok)``; ``ok=None``
is shown, not asserted. A row with ``ok`` false fails its test when the test returns (after all
its rows are recorded, so the table shows each). The rows are printed as a table at the end of a
``-m gpu`` run or with ``--gpu-table PATH``, which also writes them (``.json``: JSON, else
Markdown; ``-``: print only). Both options are registered in tests/conftest.py.
"""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Callable

import pytest
import torch

from .helpers import Shapes


ROWS = pytest.StashKey[list]()
CUDA = pytest.param("cuda", marks=pytest.mark.gpu)


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    measured: str
    threshold: str
    ok: bool | None  # None: shown, not asserted
    test: str        # node id of the test that recorded it

    @property
    def result(self) -> str:
        return "INFO" if self.ok is None else "PASS" if self.ok else "FAIL"


def _gpu_selected(config: pytest.Config) -> bool:
    """Whether ``-m`` asks for the ``gpu`` tests (``-m gpu``, ``-m "gpu and not slow"``)."""
    expr = config.getoption("markexpr") or ""
    return bool(re.search(r"\bgpu\b", expr)) and not re.search(r"\bnot\s+gpu\b", expr)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Unless ``-m`` asks for them, the ``gpu`` tests are deselected: the normal suite, on any
    machine, runs the CPU smoke only (the full set takes minutes of a GPU)."""
    if _gpu_selected(config):
        return
    full = [item for item in items if item.get_closest_marker("gpu")]
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def _cuda() -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False on this machine (the [cpu] variant is the "
                    "same check at tiny shapes)")
    return "cuda"


@pytest.fixture(params=["cpu", CUDA])
def device(request) -> str:
    """``"cpu"`` (the smoke at tiny shapes) or ``"cuda"`` (full size: ``-m gpu``, skipped without CUDA)."""
    return "cpu" if request.param == "cpu" else _cuda()


@pytest.fixture(params=[CUDA])
def cuda(request) -> str:
    """``"cuda"``, for checks that only a GPU can make (``-m gpu``, skipped without CUDA)."""
    return _cuda()


@pytest.fixture
def shapes(request) -> Shapes:
    """The sizes of the test's device (``device`` or ``cuda`` fixture)."""
    names = request.fixturenames
    return Shapes.for_device(request.getfixturevalue("device" if "device" in names else "cuda"))


@pytest.fixture
def record_row(request) -> Callable[[str, object, str, bool | None], bool | None]:
    """``record_row(check, measured, threshold, ok)``: one row of the table; returns ``ok``."""
    rows = request.config.stash.setdefault(ROWS, [])

    def record(check: str, measured: object, threshold: str, ok: bool | None) -> bool | None:
        rows.append(Row(check, str(measured), threshold, None if ok is None else bool(ok), request.node.nodeid))
        return ok

    return record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A test whose rows include a FAIL fails, naming each such row; a test that raises gets a FAIL
    row saying so (the table then lists every broken check)."""
    rows = item.config.stash.setdefault(ROWS, [])
    try:
        result = yield
    except Exception as e:  # not pytest's skip / fail outcomes, which are BaseExceptions
        if not any(r.test == item.nodeid and r.ok is False for r in rows):
            message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
            rows.append(Row(item.name, f"raised {message}", "no error", False, item.nodeid))
        raise
    failed = [r for r in rows if r.test == item.nodeid and r.ok is False]
    if failed:
        pytest.fail("rows over their threshold:\n" + "\n".join(
            f"  {r.check}: measured {r.measured}, threshold {r.threshold}" for r in failed), pytrace=False)
    return result


def table(rows: list[Row]) -> str:
    """The Markdown table of ``rows``."""
    cell = lambda text: text.replace("|", "/")  # noqa: E731 (a cell must not end the column)
    lines = ["| check | measured | threshold | result |", "|---|---|---|---|"]
    lines += [f"| {cell(r.check)} | {cell(r.measured)} | {cell(r.threshold)} | {r.result} |" for r in rows]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    rows = config.stash.get(ROWS, [])
    target = config.getoption("gpu_table", None)
    if not rows or not (target or _gpu_selected(config)):
        return
    where = torch.cuda.get_device_name() if any("[cuda" in r.test for r in rows) else "CPU (smoke, tiny shapes)"
    failed = sum(r.ok is False for r in rows)
    terminalreporter.write_sep("=", f"seqpar GPU checks on {where}, torch {torch.__version__}")
    terminalreporter.write_line(table(rows))
    terminalreporter.write_line(f"{len(rows)} rows, {failed} FAIL")
    if target and target != "-":
        path = Path(target)
        text = json.dumps([dataclasses.asdict(r) | {"result": r.result} for r in rows], indent=1)
        path.write_text(text if path.suffix == ".json" else table(rows) + "\n")
        terminalreporter.write_line(f"rows written to {path}")
