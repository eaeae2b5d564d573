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
