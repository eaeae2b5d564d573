"""The report ``seqpar verify`` prints: a table of layouts, the problems found, a one-line verdict."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .compare import Row


@dataclass
class Report:
    """Every layout's row, in the order asked, and what the run was."""

    target: str
    kind: str
    dtype: str
    tolerance: float
    steps: int
    rows: list[Row] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[Row]:
        return [r for r in self.rows if r.status in ("FAIL", "error")]

    @property
    def not_run(self) -> list[Row]:
        return [r for r in self.rows if r.status == "not run"]

    @property
    def passed(self) -> bool:
        """Every layout that applies ran and is within tolerance (and at least one ran)."""
        return not self.failed and not self.not_run and any(r.status == "ok" for r in self.rows)

    def verdict(self) -> str:
        ok = [r.layout for r in self.rows if r.status == "ok"]
        skipped = [r.layout for r in self.rows if r.status == "skipped"]
        tail = f" ({self.dtype}, tolerance {self.tolerance:.0e}, {self.seconds:.0f} s" + (
            f"; skipped: {', '.join(skipped)})" if skipped else ")")
        if self.failed:
            where = "; ".join(f"{r.layout} ({_short((r.problems or [r.reason or '?'])[0], 100)})"
                              for r in self.failed)
            return f"FAIL: {len(self.failed)} of {_n(len(self.rows))} differ from one process: {where}{tail}"
        if self.not_run:
            return (f"INCOMPLETE: the time budget ran out; not run: {', '.join(r.layout for r in self.not_run)}; "
                    f"{_n(len(ok))} equal one process{tail}")
        if not ok:
            return f"NOTHING RUN: no layout applies to {self.target}{tail}"
        return f"PASS: {_n(len(ok))} train as one process, within tolerance ({', '.join(ok)}){tail}"

    def table(self) -> str:
        head = ("layout", "ranks", "loss err", "worst grad err", "in parameter", "norm err", "masks", "time", "result")
        lines = [head]
        for r in self.rows:
            num = (lambda x: "-" if x is None else f"{x:.1e}")
            lines.append((r.layout, str(r.world or "-"), num(r.loss_err), num(r.grad_err),
                          _short(r.grad_param) if r.grad_err is not None and r.status != "skipped" else "-",
                          num(r.norm_err), r.masks, "-" if r.seconds is None else f"{r.seconds:.1f}s", r.status))
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
        out.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(out)

    def problems(self) -> list[str]:
        out = []
        for r in self.rows:
            if r.status in ("FAIL", "error"):
                out += [f"{r.layout}: {p}" for p in r.problems] or [f"{r.layout}: {r.reason}"]
            elif r.status in ("skipped", "not run"):
                out.append(f"{r.layout} {r.status}: {r.reason}")
        return out

    def text(self) -> str:
        """The whole report as printed."""
        lines = [f"seqpar verify {self.target} ({self.kind}): {self.steps} steps per layout compared with one "
                 f"process", "", self.table(), ""]
        lines += self.problems()
        lines += ([""] if self.problems() else []) + [self.verdict()]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(dict(target=self.target, kind=self.kind, dtype=self.dtype, tolerance=self.tolerance,
                               steps=self.steps, seconds=self.seconds, passed=self.passed, verdict=self.verdict(),
                               layouts=[r.to_json() for r in self.rows]), indent=2)


def _n(count: int) -> str:
    return f"{count} layout" + ("" if count == 1 else "s")


def _short(where: str | None, width: int = 44) -> str:
    if where is None:
        return "-"
    return where if len(where) <= width else "..." + where[-(width - 3):]


__all__ = ["Report"]
