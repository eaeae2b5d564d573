"""What the GPT does differently under context parallelism (``mesh.cp_size > 1``).

Every CP rank of a group receives the same full ``[b, s]`` tokens and labels and keeps its own
``s/cp`` (chunks ``r`` and ``2cp-1-r``, :mod:`seqpar.distributed.context`); SP then shards those
over TP. Learned positions are looked up at the kept tokens' positions (RoPE does the same inside
attention). The loss is the mean over the whole sequence: each rank's summed token losses and its
token count are summed over cp once, here, so the loss is identical on every CP rank and the
gradient each rank computes is its tokens' share of the one mean (the parameter gradients are
then summed over cp, once, by the data-parallel reduction).
"""
from __future__ import annotations

import torch

from ..distributed.collectives import all_reduce, check_group
from ..distributed.context import CPComm, ContextParallel, check_context_layout, context_positions, split_for_context
from ..distributed.mesh import ParallelMesh
from ..distributed.regions import reduce_from_tp
from .config import GPTConfig
from .modes import resolve_attention


def build_context(config: GPTConfig, mesh: ParallelMesh, comm: CPComm) -> ContextParallel:
    """The model's :class:`ContextParallel` (its blocks on ``model.attention``'s kernel), after the
    checks that need cp (on every rank, before any collective): ``seq_len`` into ``2*cp`` chunks
    (and ``seq_len/cp`` over ``t`` under SP), no attention dropout (not supported with cp yet)."""
    cp = mesh.cp_size
    check_context_layout(config.seq_len, cp, mesh.tp_size, config.sequence_parallel)
    if cp > 1 and config.attention_dropout > 0:
        raise ValueError(f"model.attention_dropout={config.attention_dropout} with parallel.cp={cp} is not "
                         f"supported yet (context-parallel attention has no dropout); set "
                         f"model.attention_dropout=0")
    check_group(mesh.cp_group, "GPT (cp_group)")
    return ContextParallel.of(mesh.cp_group if cp > 1 else None, comm, resolve_attention(config.attention, mesh.device))


def stream_rank(mesh: ParallelMesh) -> int:
    """The rank that seeds the per-rank dropout stream: one per (cp, tp) rank, since each holds
    other tokens (``tp_rank`` when cp = 1, so nothing changes without context parallelism)."""
    return mesh.cp_rank * mesh.tp_size + mesh.tp_rank


def split_batch(tokens: torch.Tensor, labels: torch.Tensor | None, cp: ContextParallel):
    """This CP rank's ``[b, s/cp]`` tokens and labels (chunks ``r`` and ``2cp-1-r``)."""
    if cp.size == 1:
        return tokens, labels
    keep = [split_for_context(x, cp.rank, cp.size, dim=1) if x is not None else None for x in (tokens, labels)]
    return keep[0], keep[1]


def position_rows(weight: torch.Tensor, s_local: int, start: int, n: int, cp: ContextParallel) -> torch.Tensor:
    """``[n, 1, h]``: the learned position rows of this rank's ``n`` rows of the residual stream,
    rows ``start .. start+n`` of the CP rank's ``s_local`` tokens (``start = tp_rank * n`` under SP)."""
    if cp.size == 1:
        return weight[start:start + n].unsqueeze(1)
    pos = context_positions(s_local * cp.size, cp.rank, cp.size, weight.device)[start:start + n]
    return weight.index_select(0, pos).unsqueeze(1)


def context_mean_loss(token_losses_sum: torch.Tensor, labels: torch.Tensor, cp: ContextParallel,
                      ignore_index: int = -100) -> torch.Tensor:
    """The mean loss over every CP rank's tokens: ``sum over cp of the summed losses / sum over cp
    of the counted tokens``. Forward one all-reduce of the sum (backward: identity, each rank's
    share) and one of the count."""
    count = (labels != ignore_index).sum().to(token_losses_sum.dtype)
    all_reduce(count, cp.group)
    return reduce_from_tp(token_losses_sum, cp.group) / count.clamp(min=1)
