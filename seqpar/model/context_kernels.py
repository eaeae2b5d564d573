"""One block of context-parallel attention: a chunk of queries over a chunk of keys, with its
log-sum-exp, forward and backward (:mod:`seqpar.model.context_attention` exchanges the chunks and
merges the blocks).

Tensors are in the grouped layout of :mod:`~seqpar.model.context_attention`: queries
``[b, g, (a/g) c, d]`` (the ``a/g`` query heads of a K/V head folded into rows), keys and values
``[b, g, c, d]``, the log-sum-exp ``[b, g, (a/g) c]``; all in the compute dtype (fp32, or fp64 for
fp64 inputs). A block is either full (an earlier key chunk) or causal (the same chunk: query ``i``
sees keys ``0..i``). Two kernels, the same math:

* ``math``: seqpar's own matmuls and ``exp`` on the block's ``[b, g, (a/g) c, c]`` scores, any
  device and dtype.
* ``sdpa`` (``model.attention: sdpa``): PyTorch's fused kernels that return the log-sum-exp and take
  it back in backward, so no block's scores are materialised: the CPU flash kernel
  (``_scaled_dot_product_flash_attention_for_cpu``, fp32 and fp64) and CUDA's memory-efficient one
  (``_scaled_dot_product_efficient_attention``, fp32); elsewhere (fp64 on CUDA) the math kernel.
  They see ``a`` heads, so the block's K/V heads are repeated ``a/g`` times (one ``[b, a, c, d]``
  copy each) and their gradients summed back.

Backward takes the final log-sum-exp and output of the queries (all key chunks merged), so each
block's probabilities are the final ones: ``dS = P (dP - rowsum(dO O))``, as flash attention's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

LSE_ALIGN_CUDA = 32  # the memory-efficient kernel pads the log-sum-exp's rows to a multiple of 32


def _scores(q, k, scale: float, causal: bool, reps: int) -> torch.Tensor:
    """``scale * q k^T`` ``[b, g, R, sk]``, causal within each of the ``reps`` folded query heads."""
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    if causal:
        rows, sk = s.shape[-2] // reps, s.shape[-1]
        bias = torch.full((rows, sk), float("-inf"), dtype=s.dtype, device=s.device).triu_(1)
        s.add_(bias.repeat(reps, 1))
    return s


def _heads(x: torch.Tensor, reps: int) -> torch.Tensor:
    """``[b, g, reps * c, d]`` folded queries (or their output) -> ``[b, a, c, d]``: a view."""
    b, g, rows, d = x.shape
    return x.view(b, g * reps, rows // reps, d)


def _repeat_kv(x: torch.Tensor, reps: int) -> torch.Tensor:
    """``[b, g, c, d]`` -> ``[b, a, c, d]``, K/V head ``j`` for query heads ``j reps .. j reps + reps-1``."""
    b, g, c, d = x.shape
    return x.unsqueeze(2).expand(b, g, reps, c, d).reshape(b, g * reps, c, d)


def _sum_kv(x: torch.Tensor, reps: int) -> torch.Tensor:
    """``[b, a, c, d]`` gradients of repeated K/V -> ``[b, g, c, d]``."""
    b, a, c, d = x.shape
    return x.view(b, a // reps, reps, c, d).sum(2)


def sdpa_kernel(device: torch.device, dtype: torch.dtype) -> str | None:
    """The fused kernel ``sdpa`` runs a block with on ``device`` in compute ``dtype``, or None (math)."""
    if device.type == "cpu" and dtype in (torch.float32, torch.float64):
        return "cpu-flash"
    if device.type == "cuda" and dtype == torch.float32:
        return "cuda-efficient"
    return None


@dataclass(frozen=True)
class Blocks:
    """How this layer computes its blocks: ``scale``, ``reps = a/g`` and the kernel ``kind``
    (``"math"``, ``"cpu-flash"`` or ``"cuda-efficient"``)."""

    scale: float
    reps: int
    kind: str = "math"

    @classmethod
    def of(cls, attention: str, scale: float, reps: int, device: torch.device, dtype: torch.dtype) -> "Blocks":
        """``attention`` is ``model.attention``: ``sdpa`` uses a fused kernel where one exists."""
        kind = (sdpa_kernel(device, dtype) if attention == "sdpa" else None) or "math"
        return cls(scale, reps, kind)

    def forward(self, q, k, v, causal: bool):
        """``(out [b, g, R, d], lse [b, g, R])`` of the queries ``q`` over keys ``k``, values ``v``."""
        if self.kind == "math":
            s = _scores(q, k, self.scale, causal, self.reps)
            lse = torch.logsumexp(s, dim=-1)
            return torch.matmul(torch.exp(s.sub_(lse.unsqueeze(-1))), v), lse
        qh, kh, vh = _heads(q, self.reps), _repeat_kv(k, self.reps), _repeat_kv(v, self.reps)
        if self.kind == "cpu-flash":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qh, kh, vh, 0.0, causal, scale=self.scale)
        else:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                qh, kh, vh, None, True, 0.0, causal, scale=self.scale)[:2]
            lse = lse[..., :qh.shape[2]]
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])

    def backward(self, q, k, v, out, dout, lse, delta, causal: bool):
        """``(dq, dk, dv)`` of one block from the queries' final ``out``, ``lse`` and
        ``delta = rowsum(dout * out)`` (the math kernel's; the fused ones compute it themselves)."""
        if self.kind == "math":
            p = torch.exp(_scores(q, k, self.scale, causal, self.reps).sub_(lse.unsqueeze(-1)))  # [b, g, R, sk]
            dv = torch.matmul(p.transpose(-1, -2), dout)
            ds = p.mul_(torch.matmul(dout, v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)))
            return (torch.matmul(ds, k).mul_(self.scale), torch.matmul(ds.transpose(-1, -2), q).mul_(self.scale), dv)
        r = self.reps
        qh, kh, vh, oh, doh = _heads(q, r), _repeat_kv(k, r), _repeat_kv(v, r), _heads(out, r), _heads(dout, r)
        lh = lse.view(*qh.shape[:-1])
        if self.kind == "cpu-flash":
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                doh, qh, kh, vh, oh, lh, 0.0, causal, scale=self.scale)
        else:
            rows = -(-lh.shape[-1] // LSE_ALIGN_CUDA) * LSE_ALIGN_CUDA
            padded = torch.zeros(*lh.shape[:-1], rows, dtype=lh.dtype, device=lh.device)
            padded[..., :lh.shape[-1]] = lh
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
                doh, qh, kh, vh, None, oh, padded, seed, seed, 0.0, [True, True, True, False], causal,
                scale=self.scale)[:3]
        return dq.reshape(q.shape), _sum_kv(dk, r), _sum_kv(dv, r)


__all__ = ["Blocks", "sdpa_kernel"]
