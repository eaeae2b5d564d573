"""Expert parallelism's token exchange: routed rows to the ranks holding their experts, and back.

The ``ep`` ranks of an expert-parallel group each hold ``E_l = E / ep`` consecutive experts (rank
``j``: experts ``j E_l ... (j+1) E_l - 1``). A rank's routed rows arrive sorted by expert with
``counts [E]`` rows per expert, so the rows for rank ``j`` are one contiguous block.

:func:`dispatch` (forward) -- the step's one host synchronisation per MoE layer:
1. all-to-all of the per-expert counts, ``[ep, E_l]`` int64 (``ep * E_l * 8`` bytes), so each
   rank learns how many rows it gets from each source for each of its experts;
2. ``.tolist()`` of both count tables: the row all-to-all needs its split sizes on the host;
3. all-to-all of the rows (``h`` values each); they arrive source-major, then
4. a stable reorder to expert-major (``[expert][source]``) for the grouped GEMM.

:func:`combine` undoes 4 and 3 with the same splits (no new host sync). Both all-to-alls are
differentiable: backward runs the opposite exchange with the splits swapped.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .collectives import ProcessGroup, all_to_all_rows, group_size


class _AllToAllRows(torch.autograd.Function):
    """Rows to their ranks (forward) and their gradients back (backward, splits swapped)."""

    @staticmethod
    def forward(ctx, x, group, out_rows, in_rows):
        ctx.group, ctx.out_rows, ctx.in_rows = group, out_rows, in_rows
        return all_to_all_rows(x, group, out_rows, in_rows)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all_rows(grad, ctx.group, ctx.in_rows, ctx.out_rows), None, None, None


def exchange_rows(x: torch.Tensor, group: ProcessGroup | None, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
    """Differentiable :func:`~seqpar.distributed.collectives.all_to_all_rows`."""
    if group_size(group) == 1:
        return x
    return _AllToAllRows.apply(x, group, out_rows, in_rows)


@dataclass
class Routed:
    """How rows were exchanged: what :func:`combine` needs to send them back."""

    send_rows: list[int]        # rows this rank sent to each rank of the group
    recv_rows: list[int]        # rows it received from each
    regroup: torch.Tensor       # received (source-major) row -> expert-major position, as a gather index
    local_counts: torch.Tensor  # [E_l] rows per local expert, expert-major


def dispatch(x: torch.Tensor, counts: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, Routed]:
    """``x [m, h]`` sorted by expert (``counts [E]`` rows each) -> this rank's experts' rows
    ``[m', h]``, grouped by local expert (``Routed.local_counts``). See the module docstring."""
    ep = group_size(group)
    E = counts.numel()
    local = E // ep
    table = counts.view(ep, local)
    recv = exchange_rows(table.contiguous(), group, [1] * ep, [1] * ep)  # [source, local expert]
    send_rows = table.sum(1).tolist()  # host sync: the row exchange needs its split sizes
    recv_rows = recv.sum(1).tolist()
    rows = exchange_rows(x, group, recv_rows, send_rows)  # [source][expert] blocks
    chunk = torch.repeat_interleave(torch.arange(ep * local, device=x.device), recv.reshape(-1))
    key = (chunk % local) * ep + torch.div(chunk, local, rounding_mode="floor")  # expert-major
    regroup = torch.argsort(key, stable=True)
    return rows.index_select(0, regroup), Routed(send_rows, recv_rows, regroup, recv.sum(0))


def combine(y: torch.Tensor, routed: Routed, group: ProcessGroup | None) -> torch.Tensor:
    """The experts' outputs ``y`` (as :func:`dispatch` returned their inputs) back to the ranks
    that sent the rows, in the order they were sent."""
    back = torch.empty_like(routed.regroup)
    back[routed.regroup] = torch.arange(routed.regroup.numel(), device=y.device)
    return exchange_rows(y.index_select(0, back), group, routed.send_rows, routed.recv_rows)


__all__ = ["Routed", "combine", "dispatch", "exchange_rows"]
