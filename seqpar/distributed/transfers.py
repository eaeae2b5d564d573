"""Transfers that run under computation: one ring step, and PyTorch's async-TP kernels.

:func:`ring_send_recv` is one point-to-point step of a ring: the overlapped TP layers
(:mod:`seqpar.layers.overlap`) cut an all-gather or a reduce-scatter into ``t-1`` of them, and
context parallelism's ring attention passes K/V blocks round the cp group with it. The async-TP
wrappers (:func:`async_tp_group_name`) run the fused all-gather + matmul and matmul + reduce-scatter
of symmetric memory (CUDA + NCCL). Each transfer is counted by :mod:`~seqpar.distributed.comm_counter`.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from .collectives import ProcessGroup, group_rank, group_size
from .comm_counter import record


class RingTransfer:
    """Point-to-point transfers in flight (:func:`ring_send_recv`): ``wait()`` finishes the sends
    and the receives and returns the received tensors. Holds the sent tensors until then."""

    def __init__(self, works: list, sent: list[torch.Tensor], received: list[torch.Tensor]):
        self.works, self.sent, self.received = works, sent, received

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works, self.sent = [], []
        return self.received


def ring_send_recv(tensors: list[torch.Tensor], group: ProcessGroup | None, *, tag: int = 0) -> RingTransfer:
    """Start sending ``tensors`` to the next rank of ``group`` (``r+1 mod t``) and receiving the
    previous rank's (``r-1``; same shapes and dtypes); non-blocking. ``tag`` tells the concurrent
    transfers of one exchange apart (the same on every rank). Each send is counted as
    ``send_recv`` over ``group``: a ring of ``t-1`` such steps moves what one all-gather or
    reduce-scatter does."""
    t, r = group_size(group), group_rank(group)
    nxt, prev = dist.get_global_rank(group, (r + 1) % t), dist.get_global_rank(group, (r - 1) % t)
    sent = [x.contiguous() for x in tensors]
    received = [torch.empty_like(x) for x in sent]
    ops = []
    for i, (x, into) in enumerate(zip(sent, received)):
        record("send_recv", x, group, ops=2)  # a send and a receive
        ops.append(dist.P2POp(dist.isend, x, nxt, group, tag=tag * len(sent) + i))
        ops.append(dist.P2POp(dist.irecv, into, prev, group, tag=tag * len(sent) + i))
    return RingTransfer(dist.batch_isend_irecv(ops), sent, received)


def async_tp_group_name(x: torch.Tensor, group: ProcessGroup | None) -> str | None:
    """The name of ``group`` when PyTorch's async-TP kernels (symmetric memory) can run the fused
    all-gather + matmul and matmul + reduce-scatter on ``x``: a CUDA tensor, an NCCL group of more
    than one rank, and a torch that provides ``torch.ops.symm_mem``; else ``None`` (use the
    decomposed ring). Enables symmetric memory for the group where this torch still needs it."""
    if not x.is_cuda or group is None or group_size(group) == 1 or dist.get_backend(group) != "nccl":
        return None
    try:
        from torch.distributed import _symmetric_memory as symm_mem
        ops = torch.ops.symm_mem
        ops.fused_all_gather_matmul, ops.fused_matmul_reduce_scatter  # noqa: B018 - presence check
    except (ImportError, AttributeError, RuntimeError):
        return None
    name = group.group_name
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():  # deprecated (and unneeded) on newer torch; needed on older
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(name)
    return name


def fused_all_gather_matmul(x: torch.Tensor, weight_t: torch.Tensor, group_name: str) -> torch.Tensor:
    """``all_gather(x, dim 0) @ weight_t`` by PyTorch's async-TP kernel: ``[n, ..., k]`` shards and
    ``weight_t [k, m]`` -> ``[t*n, ..., m]``; each shard's copy overlaps the previous one's matmul."""
    return torch.ops.symm_mem.fused_all_gather_matmul(x, [weight_t], 0, group_name)[1][0]


def fused_matmul_reduce_scatter(x: torch.Tensor, weight_t: torch.Tensor, group_name: str) -> torch.Tensor:
    """``reduce_scatter(x @ weight_t, dim 0)`` by PyTorch's async-TP kernel: ``[t*n, ..., k]`` ->
    ``[n, ..., m]``, each destination's partial product sent while the next one is computed."""
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, weight_t, "sum", 0, group_name)


__all__ = ["RingTransfer", "async_tp_group_name", "fused_all_gather_matmul", "fused_matmul_reduce_scatter",
           "ring_send_recv"]
