"""Rank-0 progress output: a line per log interval, a progress bar with ETA, TensorBoard scalars."""
from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import file_error


def _fmt_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def progress_bar(done: int, total: int, width: int = 20) -> str:
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


class MetricsLogger:
    """Prints on the first rank only; writes ``metrics.jsonl`` and, when the ``tensorboard``
    package is installed, TensorBoard scalars under ``out_dir``."""

    def __init__(self, out_dir: str | Path, enabled: bool, total_steps: int, start_step: int = 0):
        self.enabled, self.total, self.start_step = enabled, total_steps, start_step
        self.t0 = time.perf_counter()
        self.tb = None
        self.jsonl = None
        self.where = ""  # where the outputs go, for the run's header line (first rank)
        if enabled:
            out = Path(out_dir)
            try:
                out.mkdir(parents=True, exist_ok=True)
                self.jsonl = open(out / "metrics.jsonl", "a")
            except OSError as e:  # out_dir names a file, or a folder this user may not write
                raise file_error(f"out_dir {str(out)!r}", e) from e
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(out / "tensorboard"))
                board = f"TensorBoard {out / 'tensorboard'}"
            except ImportError:
                board = "TensorBoard off (pip install tensorboard)"
            self.where = f"metrics {out / 'metrics.jsonl'}, {board}, resolved config {out / 'config.yaml'}"

    def print(self, msg: str) -> None:
        if self.enabled:
            print(msg, flush=True)

    def log(self, step: int, scalars: dict[str, float | None]) -> None:
        """One line: step, progress bar with ETA, then the scalars in order."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        done = step - self.start_step
        eta = elapsed / max(1, done) * (self.total - step)
        parts = [f"step {step:>5}/{self.total}", f"{progress_bar(step, self.total)} ETA {_fmt_duration(eta)}"]
        for k, v in scalars.items():
            parts.append(f"{k} {'n/a' if v is None else _fmt_value(v)}")
        print(" | ".join(parts), flush=True)
        self.record(step, scalars)

    def record(self, step: int, scalars: dict[str, float | None]) -> None:
        """Write ``scalars`` (None values left out) to ``metrics.jsonl`` and TensorBoard, printing nothing."""
        if not self.enabled:
            return
        kept = {k: v for k, v in scalars.items() if v is not None}
        self.jsonl.write(json.dumps({"step": step, **kept}) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in kept.items():
                self.tb.add_scalar(k.replace(" ", "_"), v, step)

    def close(self) -> None:
        """Close the files (safe to call more than once)."""
        if self.jsonl:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


class Throughput:
    """Mean step time over the steps since the last report, as tokens/s, TFLOP/s per device and MFU."""

    def __init__(self, tokens_per_step: int, flops_per_step: float, world_size: int, peak_flops: float | None):
        self.tokens_per_step, self.flops_per_step = tokens_per_step, flops_per_step
        self.world_size, self.peak = world_size, peak_flops
        self.seconds, self.steps = 0.0, 0

    def add(self, seconds: float) -> None:
        """Count one optimizer step that took ``seconds``."""
        self.seconds += seconds
        self.steps += 1

    def report(self) -> dict[str, float | None]:
        """The window's scalars (None where unknown: no time counted, or the device's peak); starts
        a new window."""
        dt = self.seconds / max(1, self.steps)
        self.seconds, self.steps = 0.0, 0
        if dt <= 0:
            return {"tokens/s": None, "TFLOP/s": None, "MFU": None}
        per_dev = self.flops_per_step / dt / self.world_size
        return {"tokens/s": round(self.tokens_per_step / dt), "TFLOP/s": per_dev / 1e12,
                "MFU": per_dev / self.peak if self.peak else None}


def _fmt_value(v: float) -> str:
    if isinstance(v, int) or (abs(v) >= 1000 and float(v).is_integer()):
        return f"{int(v):,}"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 0.01 or v == 0:
        return f"{v:.4f}"
    return f"{v:.2e}"


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
