"""Rotary position embeddings (RoPE) on the fused ``[q | k | v]`` output of the QKV layer.

Hugging Face's rotate-half convention, so a Llama checkpoint's weights load unpermuted and give
the same logits: ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = [-x2, x1]`` (halves
of the head dim) and ``cos``/``sin`` of ``position * inv_freq`` computed in fp32, then cast to the
activation dtype. Applied to this rank's query and key heads over the full sequence (after the
SP all-gather inside the QKV layer), positions ``0 .. s-1``.

Memory: the rotation is linear, so backward needs only the cos/sin tables, not the input. The
function returns one new ``[q_rot | k_rot | v]`` buffer and keeps nothing, so the unrotated QKV
output is freed and what attention keeps is still Table 2's Q, K, V. Under selective
recomputation RoPE is *outside* the recomputed region: it runs once, before the checkpointed
attention core, whose kept inputs are exactly its output. Under full recomputation it is
recomputed with the rest of the layer.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..distributed.context import ContextParallel, context_positions
from .config import GPTConfig, RopeScaling


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """``[head_dim/2]`` inverse frequencies ``theta^(-2i/d)`` (fp32), scaled as Llama 3 does when
    ``scaling`` is given (Hugging Face's ``rope_type: llama3``)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class _RotaryQKV(torch.autograd.Function):
    """``[s, b, (a+2g)/t * d]`` -> same shape with the q and k heads rotated; keeps nothing.
    Backward applies the transposed rotation, ``g * cos - rotate_half(g * sin)``, to q and k."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, q_heads, kv_heads, head_dim):
        s, b = qkv.shape[:2]
        ctx.tables, ctx.split = (cos, sin), (q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
        ctx.head_dim = head_dim
        q, k, v = qkv.split(ctx.split, dim=-1)
        rot = [(x.view(s, b, -1, head_dim) * cos + _rotate_half(x.view(s, b, -1, head_dim)) * sin).view(s, b, -1)
               for x in (q, k)]
        return torch.cat([*rot, v], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.tables
        s, b, d = grad.shape[0], grad.shape[1], ctx.head_dim
        gq, gk, gv = grad.split(ctx.split, dim=-1)
        back = [(g.reshape(s, b, -1, d) * cos - _rotate_half(g.reshape(s, b, -1, d) * sin)).view(s, b, -1)
                for g in (gq, gk)]
        return torch.cat([*back, gv], dim=-1), None, None, None, None, None


class RopeTables:
    """cos and sin of ``position * inv_freq`` for one model, shared by its layers and cached per
    (length, dtype, device). Plain tensors, neither parameters nor buffers: nothing to checkpoint."""

    def __init__(self, config: GPTConfig):
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling)  # [d/2] fp32
        self._key, self._tables = None, None
        self._cp_key, self._cp_tables = None, None

    def get(self, s: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[s, 1, 1, d]`` of positions ``0 .. s-1``, fp32 math cast to ``dtype``."""
        key = (s, dtype, device)
        if self._key != key:
            freqs = torch.arange(s, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [s, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]                       # [s, 1, 1, d]
            self._tables = (emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device))
            self._key = key
        return self._tables

    def get_context(self, s_local: int, cp: ContextParallel, dtype: torch.dtype, device: torch.device):
        """cos and sin ``[s/cp, 1, 1, d]`` at the positions of CP rank ``cp.rank``'s tokens
        (:func:`~seqpar.distributed.context.context_positions` of ``s = s_local * cp``)."""
        key = (s_local, cp.rank, cp.size, dtype, device)
        if self._cp_key != key:
            s = s_local * cp.size
            cos, sin = self.get(s, dtype, device)
            pos = context_positions(s, cp.rank, cp.size, device)
            self._cp_tables, self._cp_key = (cos.index_select(0, pos), sin.index_select(0, pos)), key
        return self._cp_tables


class RotaryEmbedding(nn.Module):
    """Applies RoPE to a fused QKV output ``[s, b, (a+2g)/t * d]`` (this rank's heads, full sequence;
    under context parallelism ``cp``, this CP rank's ``s/cp`` tokens at their own positions)."""

    def __init__(self, tables: RopeTables, q_heads: int, kv_heads: int, head_dim: int,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.tables, self.q_heads, self.kv_heads, self.head_dim = tables, q_heads, kv_heads, head_dim
        self.cp = cp if cp is not None and cp.size > 1 else None

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        if self.cp is not None:
            cos, sin = self.tables.get_context(qkv.shape[0], self.cp, qkv.dtype, qkv.device)
        else:
            cos, sin = self.tables.get(qkv.shape[0], qkv.dtype, qkv.device)
        return _RotaryQKV.apply(qkv, cos, sin, self.q_heads, self.kv_heads, self.head_dim)

    def extra_repr(self) -> str:
        return f"q_heads={self.q_heads}, kv_heads={self.kv_heads}, head_dim={self.head_dim}"
