"""Correctness: seqpar's GPT against a plain-PyTorch reference built from its dense state dict
(tests/gpu/reference.py), fp32 with TF32 off and bf16, math and sdpa attention; at t=1, and
with tensor + sequence parallelism on several ranks."""
import json

import pytest
import torch

from seqpar.distributed import ParallelMesh
from seqpar.distributed.local import run_local

from . import tp_ranks
from .helpers import Shapes, torchrun
from .reference import correctness_rows, correctness_variants


def test_correctness(device, shapes, record_row):
    """t=1 (on CUDA: L=4, h=1024, a=16, s=1024)."""
    for dtype, attention, res in correctness_variants(shapes, ParallelMesh.single(device), sp=False):
        for row in correctness_rows(f"correctness t=1 {dtype} {attention}", dtype, res):
            record_row(*row)


def _gpu_tp(request) -> int:
    """t of the multi-GPU check: ``--gpu-tp``, else the largest power of two <= the GPU count (<= 16)."""
    t = request.config.getoption("gpu_tp")
    if t is None:
        t = 1
        while t * 2 <= min(torch.cuda.device_count(), 16):
            t *= 2
    if t < 2 or t > torch.cuda.device_count():
        pytest.skip(f"t={t} needs 2 or more GPUs, one per rank; this machine has {torch.cuda.device_count()}")
    return t


def test_tp(device, shapes, record_row, tmp_path, request):
    """The same comparison at t > 1 with SP: t=2 gloo ranks on the CPU; on CUDA one GPU per rank
    over NCCL, t = the largest power of two <= the GPU count."""
    if device == "cpu":
        t = 2
        results = run_local(tp_ranks.tp_rank, t, device, timeout=shapes.timeout_s, tmp_dir=tmp_path)[0]
    else:
        t, out = _gpu_tp(request), tmp_path / "tp.json"
        proc = torchrun(t, ["-m", "gpu.tp_ranks", str(out)], device, tmp_path, shapes.timeout_s)
        assert proc.returncode == 0, f"{t} ranks exited {proc.returncode}:\n{proc.stdout[-4000:]}"
        results = json.loads(out.read_text())
    assert len(results) == 4
    for dtype, attention, res in results:
        for row in correctness_rows(f"correctness t={t} SP {dtype} {attention}", dtype, res):
            record_row(*row)


def test_correctness_fails_against_a_perturbed_reference():
    """The reference is independent of seqpar: one edited dense weight fails the fp32 gradient rows
    (test_correctness[cpu] passes the same call without the edit)."""
    def perturb(dense):
        dense["blocks.0.attn.qkv.weight"][0, 0] += 0.1  # one entry of one query row

    results = correctness_variants(Shapes.for_device("cpu"), ParallelMesh.single("cpu"), sp=False, perturb=perturb)
    rows = [row for dtype, attention, res in results for row in correctness_rows(dtype, dtype, res)]
    grads = [ok for check, _, _, ok in rows if check.startswith("float32") and "grad" in check]
    assert len(grads) == 2 and not any(grads), rows
