"""What scripts/gpu_validate.py and its helper modules share: the table row, its verdicts, small helpers."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

NEEDS_CUDA = "needs CUDA (skipped in --device cpu mode)"


@dataclasses.dataclass(frozen=True)
class Row:
    check: str
    measured: str
    threshold: str
    result: str  # PASS, FAIL, INFO (shown, not asserted) or SKIP


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"


# the one line of a host sync under torch.cuda.set_sync_debug_mode("warn"); the mode's own notice
# ("Synchronization debug mode is a prototype feature ...") also says "synchroniz" and is no sync
SYNC_WARNING = "called a synchronizing CUDA operation"


def host_syncs(messages: list[str]) -> list[str]:
    """The warnings among ``messages`` that report a host sync (first line, cut to 80 characters)."""
    return [m.splitlines()[0][:80] for m in messages if SYNC_WARNING in m]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def fp32_exact():
    """fp32 matmuls in full precision (TF32 off) inside the block."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def batch(vocab: int, b: int, s: int, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and labels ``[b, s]``, identical on every rank (drawn on the CPU, then moved)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    return tokens.to(device), labels.to(device)
