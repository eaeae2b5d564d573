"""RMSNorm that keeps only its input for backward (and the per-token ``rstd``, ``[..., 1]``).

``y = weight * (x / sqrt(mean(x^2) + eps))``, normalised in fp32 and cast back to ``x``'s dtype
before the weight, exactly as Hugging Face's ``LlamaRMSNorm``. PyTorch's own ``nn.RMSNorm`` on
CPU is a composite of elementwise ops that keeps fp32 copies of the whole input for backward;
this one keeps Table 2's ``2sbh`` bytes (bf16) like LayerNorm, minus LayerNorm's mean.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)  # fp32 at least (fp64 stays fp64)


class _RMSNormFn(torch.autograd.Function):
    """Forward: ``n = x * rstd`` in fp32 (at least), ``y = weight * n.to(x.dtype)``. Saves ``x`` and ``rstd``.
    Backward: ``dx = rstd * (dn - n * mean(dn * n))`` with ``dn = dy * weight``; ``n`` is rebuilt."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(_compute_dtype(x))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, rstd = ctx.saved_tensors
        cd = _compute_dtype(x)
        n = x.to(cd) * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_out.to(cd) * n.to(x.dtype).to(cd)).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        dn = (grad_out * weight).to(cd)
        grad_x = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim (``[s/t, b, h]`` under SP); weight initialised to ones."""

    def __init__(self, hidden: int, eps: float = 1e-6, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def make_norm(kind: str, hidden: int, eps: float, dtype: torch.dtype) -> nn.Module:
    """``nn.LayerNorm`` (weight and bias) or :class:`RMSNorm` (weight only)."""
    if kind == "rmsnorm":
        return RMSNorm(hidden, eps=eps, dtype=dtype)
    return nn.LayerNorm(hidden, eps=eps, dtype=dtype)
