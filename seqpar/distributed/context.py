"""Context parallelism's layout and its K/V exchange over the ``cp`` group.

Layout (causal load balance): a sequence of ``s`` tokens is cut into ``2*cp`` chunks of
``c = s/(2 cp)`` tokens; CP rank ``r`` holds chunk ``r`` followed by chunk ``2cp-1-r`` (``s/cp``
tokens). Under causal attention chunk ``i``'s queries see ``i+1`` chunks of keys, so every rank
sees ``(r+1) + (2cp-r) = 2cp+1`` chunks: the same work on each. Tokens, labels and positions
(learned or RoPE) are cut with the same indices (:func:`context_positions`).

Exchange: an all-gather of each rank's K/V over cp (rank order: rank ``j``'s two chunks at rows
``[2jc, 2(j+1)c)``), its backward a reduce-scatter of the K/V gradients; or a ring of
point-to-point steps (:func:`~seqpar.distributed.transfers.ring_send_recv` over the cp group), each sending this rank's current block to ``r+1`` and
receiving ``r-1``'s, started before the current block's attention so the two overlap.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from ..errors import UserError
from .collectives import ProcessGroup, group_rank, group_size

CPComm = Literal["allgather", "ring"]
CP_COMMS: tuple[CPComm, ...] = get_args(CPComm)


def check_context_layout(seq: int, cp: int, t: int = 1, sequence_parallel: bool = False) -> None:
    """Raise :class:`~seqpar.errors.UserError` naming the values unless ``seq`` splits into ``2*cp``
    equal chunks (and, under SP, each rank's ``seq/cp`` tokens split over ``t``). Pure arithmetic."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise UserError(f"cp must be a positive integer, got cp={cp!r}")
    if cp == 1:
        return
    if seq % (2 * cp):
        raise UserError(f"sequence length {seq} is not divisible by 2 x cp = {2 * cp} (context parallelism cuts "
                        f"each sequence into 2*cp chunks for the causal load balance)")
    if sequence_parallel and (seq // cp) % t:
        raise UserError(f"sequence length {seq} / cp={cp} = {seq // cp} tokens per CP rank is not divisible by "
                        f"t={t} (sequence parallelism shards each CP rank's tokens over TP)")


def context_chunks(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunk indices CP rank ``cp_rank`` holds: ``(r, 2cp-1-r)``."""
    return cp_rank, 2 * cp - 1 - cp_rank


def context_positions(seq: int, cp_rank: int, cp: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[seq/cp]`` int64: the positions in the full sequence of CP rank ``cp_rank``'s tokens, in
    the order the rank holds them (chunk ``r``, then chunk ``2cp-1-r``)."""
    if cp == 1:
        return torch.arange(seq, device=device)
    c = seq // (2 * cp)
    first, second = context_chunks(cp_rank, cp)
    return torch.cat([torch.arange(first * c, (first + 1) * c, device=device),
                      torch.arange(second * c, (second + 1) * c, device=device)])


def split_for_context(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's tokens of ``x`` along ``dim`` (``[b, s] -> [b, s/cp]`` by default): chunks
    ``r`` and ``2cp-1-r`` concatenated (the tokens at :func:`context_positions`). A copy; the
    identity when ``cp == 1``."""
    if cp == 1:
        return x
    check_context_layout(x.shape[dim], cp)
    c = x.shape[dim] // (2 * cp)
    first, second = context_chunks(cp_rank, cp)
    return torch.cat([x.narrow(dim, first * c, c), x.narrow(dim, second * c, c)], dim=dim)


@dataclass(frozen=True)
class ContextParallel:
    """What attention needs to exchange K/V: the cp group, its size and this rank's place, the
    exchange (``"allgather"`` or ``"ring"``) and the kernel its blocks run on (``model.attention``:
    ``"math"``, or ``"sdpa"`` for PyTorch's fused kernels where they return the log-sum-exp).
    ``size == 1``: no context parallelism."""

    group: ProcessGroup | None
    size: int
    rank: int
    comm: CPComm = "allgather"
    kernel: str = "math"

    @classmethod
    def of(cls, group: ProcessGroup | None, comm: CPComm = "allgather", kernel: str = "math") -> "ContextParallel":
        if comm not in CP_COMMS:
            raise ValueError(f"parallel.cp_comm must be one of {list(CP_COMMS)}, got {comm!r}")
        if kernel not in ("math", "sdpa"):
            raise ValueError(f"model.attention must be 'math' or 'sdpa', got {kernel!r}")
        return cls(group, group_size(group), group_rank(group), comm, kernel)
