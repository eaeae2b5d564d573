"""Causal attention over the whole sequence when each CP rank holds ``s/cp`` of it.

This rank's queries are its two chunks ``(r, 2cp-1-r)`` (:mod:`seqpar.distributed.context`);
they attend to every earlier key of the full sequence. K/V reach them by

* ``allgather``: one all-gather of this rank's ``[s/cp, b, 2, g/t, d]`` K/V over cp, reordered to
  sequence order; query chunk ``i`` then attends to the keys of chunks ``0..i``, one ``[c, c]``
  block at a time. Backward gathers again and reduce-scatters the K/V gradients (never keeping
  the full K/V).
* ``ring``: ``cp - 1`` point-to-point steps; each step's transfer of the next K/V block is started
  before this block's attention. Backward rotates K/V again, the K/V gradients travelling with
  them back to their owner (``cp`` gradient transfers).

Per block the math is flash attention's: partial outputs and their log-sum-exp, merged exactly
(``logaddexp``), computed in fp32 at least. A block is one chunk pair (``c = s/(2cp)`` queries and
keys), so the transient is bounded by one chunk pair in both exchanges. Blocks run on seqpar's own
kernel (matmuls and exp on ``[b, a/t, c, c]`` scores, any device) or, with ``model.attention:
sdpa``, on PyTorch's fused kernels that return the log-sum-exp (:mod:`.context_kernels`; the CPU
flash kernel, CUDA's memory-efficient one). Backward recomputes each block's probabilities from
the saved log-sum-exp (``dS = P * (dP - rowsum(dO * O))``), so what a layer keeps is its own
q, k, v, the output and the ``[b, a/t, s/cp]`` log-sum-exp: never an ``s x s`` term, whatever the
recompute mode. Grouped-query attention folds the ``a/g`` query heads of a K/V head into rows
(``[b, g, (a/g) * c, d]``), so only the ``g`` K/V heads move.
"""
from __future__ import annotations

import torch

from ..distributed.collectives import all_gather_dim0, reduce_scatter_dim0
from ..distributed.context import ContextParallel, context_chunks, context_positions
from ..distributed.transfers import ring_send_recv
from .context_kernels import Blocks


def _fold_q(q: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """``[c, b, a, d] -> [b, g, (a/g) * c, d]``: query head ``i`` with K/V head ``i // (a/g)``."""
    c, b, a, d = q.shape
    return q.permute(1, 2, 0, 3).reshape(b, g, (a // g) * c, d).to(dtype)


def _unfold(o: torch.Tensor, a: int, c: int) -> torch.Tensor:
    """``[b, g, (a/g) * c, d] -> [c, b, a * d]``."""
    b, d = o.shape[0], o.shape[-1]
    return o.reshape(b, a, c, d).permute(2, 0, 1, 3).reshape(c, b, a * d)


def merge(out, lse, o2, l2):
    """Combine two partial attentions of the same queries by their log-sum-exp (exact)."""
    if out is None:
        return o2, l2
    new = torch.logaddexp(lse, l2)
    return out * torch.exp(lse - new).unsqueeze(-1) + o2 * torch.exp(l2 - new).unsqueeze(-1), new


def _pairs(q_chunks: tuple[int, int], k_chunks: tuple[int, int]):
    """``(qi, kj, causal)`` of every visible (query chunk, key chunk) pair, by index in the tuples:
    earlier key chunks fully, the same chunk causally, later ones never."""
    for i, qc in enumerate(q_chunks):
        for j, kc in enumerate(k_chunks):
            if kc <= qc:
                yield i, j, kc == qc


# --------------------------------------------------------------------------- all-gather


def _natural_order(s_local: int, cp: ContextParallel, device) -> torch.Tensor:
    """Positions of the gathered rows (rank order): ``gathered[argsort(pos)]`` is sequence order."""
    s = s_local * cp.size
    return torch.cat([context_positions(s, j, cp.size, device) for j in range(cp.size)])


def _gather_kv(k, v, cp: ContextParallel, dtype):
    """K/V of the whole sequence in sequence order, ``[b, g, s, d]`` each."""
    kv, _ = all_gather_dim0(torch.stack([k, v], dim=1), cp.group)   # [s, 2, b, g, d], rank order
    pos = _natural_order(k.shape[0], cp, k.device)
    kv = kv.index_select(0, torch.argsort(pos)).to(dtype)           # sequence order
    return kv[:, 0].permute(1, 2, 0, 3), kv[:, 1].permute(1, 2, 0, 3), pos


def _allgather_forward(qs, k, v, cp: ContextParallel, blocks: Blocks, dtype):
    kf, vf, _ = _gather_kv(k, v, cp, dtype)
    c = k.shape[0] // 2
    acc = [(None, None), (None, None)]
    for i, chunk in enumerate(context_chunks(cp.rank, cp.size)):
        for j in range(chunk + 1):  # key chunks 0..chunk, one [c, c] block each (bounded transient)
            rows = slice(j * c, (j + 1) * c)
            acc[i] = merge(*acc[i], *blocks.forward(qs[i], kf[:, :, rows], vf[:, :, rows], j == chunk))
    return acc


def _allgather_backward(qs, k, v, grads, cp: ContextParallel, blocks: Blocks, dtype):
    kf, vf, pos = _gather_kv(k, v, cp, dtype)
    c = k.shape[0] // 2
    dkf, dvf, dqs = torch.zeros_like(kf), torch.zeros_like(vf), [torch.zeros_like(q) for q in qs]
    for i, chunk in enumerate(context_chunks(cp.rank, cp.size)):
        for j in range(chunk + 1):
            rows = slice(j * c, (j + 1) * c)
            dq, dk, dv = blocks.backward(qs[i], kf[:, :, rows], vf[:, :, rows], *grads[i], j == chunk)
            dqs[i] += dq
            dkf[:, :, rows] += dk
            dvf[:, :, rows] += dv
    dkv = torch.stack([dkf, dvf]).permute(3, 0, 1, 2, 4).index_select(0, pos)  # [s, 2, b, g, d], rank order
    dkv, _ = reduce_scatter_dim0(dkv.to(k.dtype), cp.group)                    # [s/cp, 2, b, g, d]
    return dqs, dkv[:, 0], dkv[:, 1]


# --------------------------------------------------------------------------- ring


def _ring_forward(qs, k, v, cp: ContextParallel, blocks: Blocks, dtype):
    c, mine = k.shape[0] // 2, context_chunks(cp.rank, cp.size)
    kv = torch.stack([k, v])                                          # [2, s/cp, b, g, d]
    acc = [(None, None), (None, None)]
    for step in range(cp.size):
        pending = ring_send_recv([kv], cp.group, tag=step) if step < cp.size - 1 else None
        src = (cp.rank - step) % cp.size
        kb = kv.to(dtype).permute(0, 2, 3, 1, 4)                       # [2, b, g, s/cp, d]
        for i, j, causal in _pairs(mine, context_chunks(src, cp.size)):
            rows = slice(j * c, (j + 1) * c)
            acc[i] = merge(*acc[i], *blocks.forward(qs[i], kb[0][:, :, rows], kb[1][:, :, rows], causal))
        if pending is not None:
            kv = pending.wait()[0]
    return acc


def _ring_backward(qs, k, v, grads, cp: ContextParallel, blocks: Blocks, dtype):
    c, mine, n = k.shape[0] // 2, context_chunks(cp.rank, cp.size), cp.size
    kv = torch.stack([k, v])
    dqs, sent = [torch.zeros_like(q) for q in qs], None
    for step in range(n):
        pending = ring_send_recv([kv], cp.group, tag=2 * step) if step < n - 1 else None
        src = (cp.rank - step) % n
        kb = kv.to(dtype).permute(0, 2, 3, 1, 4)                       # [2, b, g, s/cp, d]
        dkv = torch.zeros_like(kb)
        for i, j, causal in _pairs(mine, context_chunks(src, n)):
            rows = slice(j * c, (j + 1) * c)
            dq, dk, dv = blocks.backward(qs[i], kb[0][:, :, rows], kb[1][:, :, rows], *grads[i], causal)
            dqs[i] += dq
            dkv[0][:, :, rows] += dk
            dkv[1][:, :, rows] += dv
        if sent is not None:  # the gradient of this block so far, from the ranks before
            dkv += sent.wait()[0]
        sent = ring_send_recv([dkv], cp.group, tag=2 * step + 1)
        if pending is not None:
            kv = pending.wait()[0]
    dkv = sent.wait()[0].permute(0, 3, 1, 2, 4).to(k.dtype)           # [2, s/cp, b, g, d], this rank's own
    return dqs, dkv[0], dkv[1]


# --------------------------------------------------------------------------- autograd


class _ContextAttention(torch.autograd.Function):
    """q ``[s/cp, b, a/t, d]``, k/v ``[s/cp, b, g/t, d]`` -> ``[s/cp, b, a/t * d]``, causal over
    the full sequence. Saves q, k, v, the output and the log-sum-exp; backward re-exchanges K/V."""

    @staticmethod
    def forward(ctx, q, k, v, cp: ContextParallel, scale: float):
        s_local, b, a, d = q.shape
        g, c = k.shape[2], s_local // 2
        dtype = torch.promote_types(q.dtype, torch.float32)
        blocks = Blocks.of(cp.kernel, scale, a // g, q.device, dtype)
        qs = [_fold_q(x, g, dtype) for x in (q[:c], q[c:])]
        run = _ring_forward if cp.comm == "ring" else _allgather_forward
        results = run(qs, k, v, cp, blocks, dtype)
        out = torch.cat([_unfold(o, a, c) for o, _ in results]).to(q.dtype)  # [s/cp, b, a/t * d]
        ctx.cp, ctx.blocks = cp, blocks
        ctx.save_for_backward(q, k, v, out, *(lse for _, lse in results))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse0, lse1 = ctx.saved_tensors
        s_local, b, a, d = q.shape
        g, c = k.shape[2], s_local // 2
        dtype = lse0.dtype
        qs = [_fold_q(x, g, dtype) for x in (q[:c], q[c:])]
        douts = [_fold_q(x.view(c, b, a, d), g, dtype) for x in (dout[:c], dout[c:])]
        outs = [_fold_q(x.view(c, b, a, d), g, dtype) for x in (out[:c], out[c:])]
        # per query chunk what each block's backward needs: the final output, its gradient, the final
        # log-sum-exp and rowsum(dO * O) (the math kernel's; the fused ones compute it)
        grads = [(o, do, lse, (o * do).sum(-1)) for o, do, lse in zip(outs, douts, (lse0, lse1))]
        run = _ring_backward if ctx.cp.comm == "ring" else _allgather_backward
        dqs, dk, dv = run(qs, k, v, grads, ctx.cp, ctx.blocks, dtype)
        dq = torch.cat([x.reshape(b, a, c, d).permute(2, 0, 1, 3) for x in dqs]).to(q.dtype)
        return dq, dk, dv, None, None


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel,
                      scale: float) -> torch.Tensor:
    """Causal attention of this CP rank's queries over the whole sequence (see the module
    docstring). q ``[s/cp, b, a/t, d]``, k and v ``[s/cp, b, g/t, d]`` -> ``[s/cp, b, a/t * d]``."""
    if q.shape[0] % 2:
        raise ValueError(f"context_attention: {q.shape[0]} local tokens are not two equal chunks")
    return _ContextAttention.apply(q, k, v, cp, scale)
