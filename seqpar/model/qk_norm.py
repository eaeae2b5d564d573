"""QK-norm (Qwen3): an RMSNorm over each query and key head (``head_dim`` wide) before RoPE.

Acts on the fused ``[q_r | k_r | v_r]`` buffer of a rank's heads, ``[s, b, (a+2g)/t * d]``. Each
norm's weight ``[d]`` is shared by all heads, so at ``t > 1`` every TP rank's gradient covers only
its own heads: the weights are declared SP-replicated and their gradients summed over TP.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..sharding import mark_sp_replicated
from .norm import RMSNorm


class QKNorm(nn.Module):
    """``q_norm`` on the ``a`` local query heads and ``k_norm`` on the ``g`` local key heads."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, eps: float, dtype: torch.dtype, t: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_norm = RMSNorm(head_dim, eps=eps, dtype=dtype)
        self.k_norm = RMSNorm(head_dim, eps=eps, dtype=dtype)
        if t > 1:
            mark_sp_replicated(self.q_norm)
            mark_sp_replicated(self.k_norm)

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b = qkv.shape[:2]
        a, g, d = self.heads, self.kv_heads, self.head_dim
        q, k, v = qkv.split((a * d, g * d, g * d), dim=-1)
        q = self.q_norm(q.reshape(s, b, a, d)).view(s, b, a * d)
        k = self.k_norm(k.reshape(s, b, g, d)).view(s, b, g * d)
        return torch.cat([q, k, v], dim=-1)
