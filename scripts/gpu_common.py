"""What scripts/gpu_validate.py and its helper modules share: the table row and its verdicts."""
from __future__ import annotations

import dataclasses

NEEDS_CUDA = "needs CUDA (skipped in --device cpu mode)"


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    measured: str
    threshold: str
    result: str  # PASS, FAIL, INFO (shown, not asserted) or SKIP


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
