"""What the GPU checks share: their shapes per device, timing and precision helpers, torchrun."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# the one line of a host sync under torch.cuda.set_sync_debug_mode("warn"); the mode's own notice
# ("Synchronization debug mode is a prototype feature ...") also says "synchroniz" and is no sync
SYNC_WARNING = "called a synchronizing CUDA operation"


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Model sizes of every check: full size on CUDA, tiny for the CPU smoke."""

    model: dict              # GPTConfig fields of the correctness, rng and memory checks
    batch: int               # sequences per forward in those checks
    depths: tuple[int, int]  # memory: layers of the two models whose difference is measured
    big: dict                # GPTConfig fields of the throughput check
    big_batch: int
    steps: int               # throughput: timed steps per recompute mode (after `warmup`)
    warmup: int
    run_model: list[str]     # model overrides of the Trainer runs (resume, precision, 2 ranks, ...)
    launcher_model: list[str]  # model overrides of the launcher's tiny-cpu runs
    compile_backend: str     # torch.compile backend of the compiled-blocks row
    timeout_s: int           # each torchrun or run_local call

    @classmethod
    def for_device(cls, device: str) -> "Shapes":
        if device == "cpu":
            tiny = dict(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2)
            run = ["model.hidden=64", "model.heads=4", "model.layers=4", "model.seq_len=32"]
            # aot_eager: the same tracing and compiled-block path without Inductor's C++ builds
            return cls(tiny, 2, (2, 4), tiny, 2, steps=2, warmup=1, run_model=run,
                       launcher_model=["model.hidden=64", "model.layers=2", "model.seq_len=64"],
                       compile_backend="aot_eager", timeout_s=300)
        model = dict(vocab_size=50304, seq_len=1024, hidden=1024, heads=16, layers=4)
        big = dict(vocab_size=50304, seq_len=2048, hidden=2048, heads=16, layers=24)
        run = ["model.hidden=256", "model.heads=8", "model.layers=4", "model.seq_len=256"]
        return cls(model, 2, (2, 4), big, 4, steps=8, warmup=3, run_model=run, launcher_model=[],
                   compile_backend="inductor", timeout_s=240)


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


def max_rel(a: list[float], b: list[float]) -> float:
    """Largest ``|a - b| / |b|`` over two loss curves (inf when their lengths differ)."""
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


def torchrun(nproc: int, args: list[str], device: str, tmp: Path, timeout_s: int) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node nproc ARGS`` with this checkout and its test helpers
    importable, caches in ``tmp``, GPUs hidden for ``device == "cpu"``; stdout and stderr together."""
    path = [str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, path)), SEQPAR_CACHE=str(tmp / "cache"),
               PYTHONUNBUFFERED="1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU even on a GPU machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    try:
        return subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return subprocess.CompletedProcess(cmd, 124, out + f"\n(timed out after {timeout_s} s)")
