"""Overlapped TP communication under sequence parallelism (``parallel.tp_overlap``).

SP's all-gather before a column-parallel GEMM (the paper's g) and its reduce-scatter after a
row-parallel GEMM (g-bar) are cut into per-rank chunks, so that each chunk's transfer runs under
another chunk's GEMM. The transfers are a ring of ``t-1`` point-to-point steps
(:func:`~seqpar.distributed.transfers.ring_send_recv`), one shard each:

======================  ====================================  =========================================
function                forward                               backward
======================  ====================================  =========================================
all_gather_linear (g)   each arriving input shard's GEMM      the input re-gathered under the grad-input
                        under the next shard's transfer       GEMMs; grad-input chunks reduce-scattered
                                                              under the weight-grad GEMMs
linear_reduce_scatter   the partial product for the next      the grad shards gathered, each one's
(g-bar)                 rank computed while the running sum   grad-input and weight-grad GEMMs under
                        of the previous one is in flight      the next one's transfer
======================  ====================================  =========================================

Same bytes on the wire as the plain collectives (``t-1`` shards per rank: ``(t-1)/t`` of the full
tensor), same tensors saved for backward (the column GEMM keeps only its input shard). On CUDA
with an NCCL group the forward uses PyTorch's async-TP kernels (symmetric memory) instead of the
ring. Results equal the plain layers' up to the order of floating-point sums.

Sequence-first: a shard is ``[n, ..., k]`` with ``n = s/t`` and chunk ``c`` of a full tensor is
rows ``[c*n, (c+1)*n)``; other sequence dims are moved to the front (a view) and back.
"""
from __future__ import annotations

import torch

from ..distributed.collectives import ProcessGroup, group_rank, group_size
from ..distributed.transfers import async_tp_group_name, fused_all_gather_matmul, fused_matmul_reduce_scatter, ring_send_recv


def _rows(x: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    return x.narrow(0, chunk * n, n)


def _linear_into(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out = x @ weight.T + bias`` written in place (``out`` a contiguous chunk of rows)."""
    x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
    if bias is None:
        torch.mm(x2, weight.t(), out=out2)
    else:
        torch.addmm(bias, x2, weight.t(), out=out2)


def _add_weight_grad(acc: torch.Tensor | None, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``acc + grad^T @ x`` over all leading dims: ``[..., m]``, ``[..., k]`` -> ``[m, k]``."""
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return g2.t().mm(x2) if acc is None else acc.addmm_(g2.t(), x2)


def ring_all_gather_linear(x, weight, bias, group) -> torch.Tensor:
    """``all_gather(x) @ weight.T + bias``: ``[n, ..., k] -> [t*n, ..., m]``. Step ``j`` passes the
    shard of rank ``r-j`` on to ``r+1`` while computing that shard's rows of the output."""
    t, r, n = group_size(group), group_rank(group), x.shape[0]
    out = x.new_empty((t * n, *x.shape[1:-1], weight.shape[0]))
    shard = x.contiguous()
    for j in range(t):
        pending = ring_send_recv([shard], group, tag=j) if j < t - 1 else None
        _linear_into(_rows(out, (r - j) % t, n), shard, weight, bias)  # under the next shard's transfer
        if pending is not None:
            shard = pending.wait()[0]
    return out


def ring_linear_reduce_scatter(x, weight, group) -> torch.Tensor:
    """``reduce_scatter(x @ weight.T)``: ``[t*n, ..., k] -> [n, ..., m]``. Step ``j`` computes the
    partial product of chunk ``r-j-1``, adds the running sum of that chunk received from ``r-1``
    and passes it on to ``r+1``; after ``t`` steps the sum of chunk ``r`` is complete here."""
    t, r = group_size(group), group_rank(group)
    n = x.shape[0] // t
    part, pending = None, None
    for j in range(t):
        part = torch.matmul(_rows(x, (r - j - 1) % t, n), weight.t())  # under the previous sum's transfer
        if pending is not None:
            part += pending.wait()[0]
        if j < t - 1:
            pending = ring_send_recv([part], group, tag=j)
    return part


def ring_all_gather_linear_grads(grad_out, x, weight, group, need_input: bool, need_weight: bool):
    """Backward of :func:`ring_all_gather_linear`: ``grad_input = reduce_scatter(grad_out @
    weight)`` ``[n, ..., k]`` and ``grad_weight = grad_out^T @ all_gather(x)`` ``[m, k]``. Step
    ``j`` forwards the shard of rank ``r-j`` (the re-gather) and the running grad-input sum of
    chunk ``r-j-1`` (the reduce-scatter), both under the weight-grad GEMM of the shard in hand."""
    t, r, n = group_size(group), group_rank(group), x.shape[0]
    grad_input = grad_weight = gathering = scattering = None
    shard = x.contiguous()
    for j in range(t):
        last = j == t - 1
        if need_weight and not last:
            gathering = ring_send_recv([shard], group, tag=2 * j)
        if need_input:
            grad_input = torch.matmul(_rows(grad_out, (r - j - 1) % t, n), weight)  # [n, ..., k]
            if scattering is not None:
                grad_input += scattering.wait()[0]
            if not last:
                scattering = ring_send_recv([grad_input], group, tag=2 * j + 1)
        if need_weight:
            grad_weight = _add_weight_grad(grad_weight, _rows(grad_out, (r - j) % t, n), shard)
            if gathering is not None:
                shard, gathering = gathering.wait()[0], None
    return grad_input, grad_weight


def ring_linear_reduce_scatter_grads(grad_out, x, weight, group, need_input: bool, need_weight: bool):
    """Backward of :func:`ring_linear_reduce_scatter`: the grad shards ``[n, ..., m]`` gathered
    in a ring, each shard's ``grad_input`` rows (``@ weight``, ``[t*n, ..., k]``) and its share of
    ``grad_weight = all_gather(grad_out)^T @ x`` computed under the next shard's transfer."""
    t, r, n = group_size(group), group_rank(group), grad_out.shape[0]
    grad_input = grad_out.new_empty((t * n, *grad_out.shape[1:-1], weight.shape[1])) if need_input else None
    grad_weight = None
    shard = grad_out.contiguous()
    for j in range(t):
        pending = ring_send_recv([shard], group, tag=j) if j < t - 1 else None
        chunk = (r - j) % t
        if need_input:
            _linear_into(_rows(grad_input, chunk, n), shard, weight.t(), None)
        if need_weight:
            grad_weight = _add_weight_grad(grad_weight, shard, _rows(x, chunk, n))
        if pending is not None:
            shard = pending.wait()[0]
    return grad_input, grad_weight


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _cast(dtype: torch.dtype | None, *tensors):
    """The tensors in the autocast compute dtype (as the plain layers' GEMMs see them)."""
    return tuple(x if x is None or dtype is None else x.to(dtype) for x in tensors)


class _AllGatherLinearFn(torch.autograd.Function):
    """g fused into a column-parallel GEMM, overlapped: shard ``[n, ..., k]`` -> ``[t*n, ..., m/t]``.

    Forward: ring all-gather, each shard's GEMM under the next one's transfer (CUDA + NCCL:
    ``symm_mem.fused_all_gather_matmul``). Saves only the shard, as the plain SP column layer.
    Backward: the shard re-gathered under the grad-input GEMMs, the grad-input reduce-scattered
    under the weight-grad GEMMs, chunk by chunk.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.device_type, ctx.dtype = x.device.type, _autocast_dtype(x.device.type)
        x, w, b = _cast(ctx.dtype, x, weight, bias)
        ctx.save_for_backward(x, weight)
        with torch.autocast(ctx.device_type, enabled=False):
            name = async_tp_group_name(x, group)
            if name is None:
                return ring_all_gather_linear(x, w, b, group)
            out = fused_all_gather_matmul(x, w.t(), name)
            return out if b is None else out.add_(b)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out, w = _cast(ctx.dtype, grad_out.contiguous(), weight)
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        with torch.autocast(ctx.device_type, enabled=False):
            grad_input, grad_weight = ring_all_gather_linear_grads(grad_out, x, w, ctx.group, need_input, need_weight)
            grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias and need_bias else None
        return grad_input, grad_weight, grad_bias, None


class _LinearReduceScatterFn(torch.autograd.Function):
    """A row-parallel GEMM fused with g-bar, overlapped: ``[t*n, ..., k/t]`` -> ``[n, ..., m]``.

    Forward: ring reduce-scatter, each partial product computed while the previous one is in
    flight (CUDA + NCCL: ``symm_mem.fused_matmul_reduce_scatter``). Saves the input, as the plain
    row layer's GEMM does. Backward: the grad shards ring-gathered, each one's grad-input and
    weight-grad GEMMs under the next one's transfer.
    """

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.device_type, ctx.dtype = x.device.type, _autocast_dtype(x.device.type)
        x, w = _cast(ctx.dtype, x, weight)
        ctx.save_for_backward(x, weight)
        with torch.autocast(ctx.device_type, enabled=False):
            name = async_tp_group_name(x, group)
            if name is None:
                return ring_linear_reduce_scatter(x, w, group)
            return fused_matmul_reduce_scatter(x.contiguous(), w.t(), name)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_out, w = _cast(ctx.dtype, grad_out, weight)
        need_input, need_weight = ctx.needs_input_grad[:2]
        with torch.autocast(ctx.device_type, enabled=False):
            grads = ring_linear_reduce_scatter_grads(grad_out, x, w, ctx.group, need_input, need_weight)
        return *grads, None


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      group: ProcessGroup | None, seq_dim: int = 0) -> torch.Tensor:
    """Overlapped column-parallel GEMM under SP: sequence shard ``[s/t, b, k]`` times this rank's
    ``weight [m/t, k]`` -> ``[s, b, m/t]`` (``seq_dim`` selects the sequence dim)."""
    if group_size(group) == 1:
        return torch.nn.functional.linear(x, weight, bias)
    if seq_dim % x.dim() == 0:
        return _AllGatherLinearFn.apply(x, weight, bias, group)
    return _AllGatherLinearFn.apply(x.movedim(seq_dim, 0), weight, bias, group).movedim(0, seq_dim)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: ProcessGroup | None,
                          seq_dim: int = 0) -> torch.Tensor:
    """Overlapped row-parallel GEMM under SP: ``[s, b, k/t]`` times this rank's ``weight [m, k/t]``,
    summed over the group and scattered along the sequence -> ``[s/t, b, m]`` (no bias)."""
    t = group_size(group)
    if t == 1:
        return torch.nn.functional.linear(x, weight)
    if x.dim() < 2 or x.shape[seq_dim] % t:
        raise ValueError(f"linear_reduce_scatter: the sequence dim seq_dim={seq_dim} of shape {tuple(x.shape)} "
                         f"is not divisible by the tensor-parallel size t={t}")
    if seq_dim % x.dim() == 0:
        return _LinearReduceScatterFn.apply(x, weight, group)
    return _LinearReduceScatterFn.apply(x.movedim(seq_dim, 0), weight, group).movedim(0, seq_dim)
