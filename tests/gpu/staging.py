"""Pipeline send/recv staged through host memory, for two gloo ranks on one GPU.

NCCL refuses two ranks on one GPU, so the two-rank checks put both ranks in a gloo group working
on ``cuda:0`` (``init_parallel(backend="gloo", device="cuda:0")``): gloo carries CUDA tensors
through host memory for all-reduce, all-gather, all-to-all and broadcast, but has no CUDA
send/recv. :func:`host_staged_p2p` stages the pipeline's point-to-point transfers through CPU
copies (validation only: torchrun with NCCL, one GPU per rank, needs none of this).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class Staged:
    """Work handle of a point-to-point transfer staged through host memory: ``wait()`` finishes
    the transfer, then copies a received buffer into its device tensor."""

    def __init__(self, work, host: torch.Tensor, target: torch.Tensor | None):
        self.work, self.host, self.target = work, host, target

    def wait(self, *args) -> bool:
        if self.work is not None:
            self.work.wait(*args)
        if self.target is not None:
            with torch.no_grad():  # pipelining's receive buffers are leaves that require grad
                self.target.copy_(self.host)
            self.target = None
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


@contextlib.contextmanager
def host_staged_p2p(stage_cpu: bool = False):
    """Inside the block, ``isend`` / ``irecv`` of a non-CPU tensor go through a CPU copy (gloo
    reads and writes host memory only). ``batch_isend_irecv`` and ``P2POp`` see the staged
    functions, so torch's pipelining schedules use them unchanged. ``stage_cpu`` stages CPU
    tensors too (the CPU smoke runs the staging that way)."""
    c10d = dist.distributed_c10d
    real_isend, real_irecv = c10d.isend, c10d.irecv

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        if tensor.device.type == "cpu" and not stage_cpu:
            return real_isend(tensor, dst, group, tag, group_dst=group_dst)
        host = tensor.detach().to("cpu", copy=True)  # a blocking copy: the bytes are ready when gloo sends
        return Staged(real_isend(host, dst, group, tag, group_dst=group_dst), host, None)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        if tensor.device.type == "cpu" and not stage_cpu:
            return real_irecv(tensor, src, group, tag, group_src=group_src)
        host = torch.empty(tensor.shape, dtype=tensor.dtype)
        return Staged(real_irecv(host, src, group, tag, group_src=group_src), host, tensor)

    c10d.isend, c10d.irecv, dist.isend, dist.irecv = isend, irecv, isend, irecv
    try:
        yield
    finally:
        c10d.isend, c10d.irecv, dist.isend, dist.irecv = real_isend, real_irecv, real_isend, real_irecv
