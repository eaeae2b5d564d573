"""Self-attention: fused QKV column-parallel linear -> CoreAttention -> row-parallel projection.

Under TP each rank owns ``a/t`` heads. The fused QKV layer is column-parallel with 3 chunks: the
dense weight is ``[q; k; v]`` and rank ``r`` holds ``[q_r; k_r; v_r]`` (its heads of each), as its
layout declares (:mod:`seqpar.sharding`), so the dense state dict stays layout-invariant.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.rng import RNGStreams
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..recompute import checkpoint
from .config import GPTConfig


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) -> dropout -> times V, for this rank's heads.

    q, k, v: ``[s, b, a/t, d]`` -> ``[s, b, a/t * d]``. This is the part that selective
    recomputation recomputes: in bf16 it keeps ``5as^2b/t`` bytes (softmax output, 1-byte dropout
    mask, dropout output) for ``4bs^2h/t`` FLOPs.
    """

    def __init__(self, config: GPTConfig, streams: RNGStreams):
        super().__init__()
        self.p, self.kind, self.streams = config.attention_dropout, config.attention, streams
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._bias, self._bias_key = None, None

    def _causal_bias(self, s: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[s, s]`` with -inf above the diagonal, 0 elsewhere; cached per shape/dtype/device."""
        key = (s, dtype, device)
        if self._bias_key != key:
            self._bias = torch.full((s, s), float("-inf"), dtype=dtype, device=device).triu_(1)
            self._bias_key = key
        return self._bias

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b, a, d = q.shape
        p = self.p if self.training else 0.0
        with self.streams.fork("tp"):  # each TP rank holds different heads: different masks
            if self.kind == "sdpa":
                qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, a, s, d] views
                out = F.scaled_dot_product_attention(qh, kh, vh, dropout_p=p, is_causal=True)
                return out.permute(2, 0, 1, 3).reshape(s, b, a * d)
            qb = q.permute(1, 2, 0, 3).reshape(b * a, s, d)           # [b*a, s, d]
            kt = k.permute(1, 2, 3, 0).reshape(b * a, d, s)           # [b*a, d, s]
            vb = v.permute(1, 2, 0, 3).reshape(b * a, s, d)
            # one fused op: causal bias + scale * QK^T (the bias is a broadcast view, never saved)
            scores = torch.baddbmm(self._causal_bias(s, q.dtype, q.device).expand(b * a, s, s), qb, kt,
                                   alpha=self.scale)                  # [b*a, s, s]
            # in the scores' dtype (bf16 stays bf16, accumulated in fp32 by the kernel): autocast would
            # upcast the output to fp32 and double the 2as^2b bytes Table 2 counts for it
            with torch.autocast(q.device.type, enabled=False):
                probs = torch.softmax(scores, dim=-1)
            if p > 0:
                probs, _ = torch.native_dropout(probs, p, True)        # keeps a 1-byte mask
            ctx = torch.bmm(probs, vb)                                 # [b*a, s, d]
        return ctx.view(b, a, s, d).permute(2, 0, 1, 3).reshape(s, b, a * d)  # [s, b, a/t * d]


class SelfAttention(nn.Module):
    """``[s/t, b, h]`` (SP) or ``[s, b, h]`` -> same shape. QKV all-gathers the sequence under SP
    (inside the column layer), the projection reduce-scatters it back."""

    def __init__(self, config: GPTConfig, tp_group, streams: RNGStreams, layer_std: tuple[float, float]):
        super().__init__()
        t = self.t = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        h, dt, sp = config.hidden, config.torch_dtype, config.sequence_parallel
        std, out_std = layer_std
        self.local_heads, self.head_dim = config.heads // t, config.head_dim
        self.streams = streams
        self.recompute = False  # set by the model for selective recomputation

        self.qkv = ColumnParallelLinear(h, 3 * h, bias=config.bias, tp_group=tp_group, sequence_parallel=sp,
                                        dtype=dt, init_method=lambda w: nn.init.normal_(w, 0.0, std), chunks=3)
        self.core = CoreAttention(config, streams)
        self.proj = RowParallelLinear(h, h, bias=config.bias, tp_group=tp_group, sequence_parallel=sp, dtype=dt,
                                      init_method=lambda w: nn.init.normal_(w, 0.0, out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                   # [s, b, 3h/t] = [q_r | k_r | v_r]
        s, b = qkv.shape[:2]
        q, k, v = qkv.view(s, b, 3, self.local_heads, self.head_dim).unbind(2)  # 3 x [s, b, a/t, d] views
        if self.recompute:
            ctx = checkpoint(self.core, q, k, v, streams=self.streams)  # keeps only q, k, v
        else:
            ctx = self.core(q, k, v)
        return self.proj(ctx)                               # [s, b, h/t] -> [s/t, b, h] (SP)
