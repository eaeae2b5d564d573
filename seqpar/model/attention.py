"""Self-attention: fused QKV column-parallel linear -> [RoPE] -> CoreAttention -> row-parallel projection.

Under TP each rank owns ``a/t`` query heads and ``g/t`` key/value heads (``g = a`` unless
grouped-query attention). The fused QKV layer is column-parallel with chunks ``(a, g, g)``: the
dense weight is ``[q; k; v]`` and rank ``r`` holds ``[q_r; k_r; v_r]`` (its heads of each), as
its layout declares (:mod:`seqpar.sharding`), so the dense state dict stays layout-invariant.
Query head ``i`` attends with key/value head ``i // (a/g)`` (Hugging Face's ``repeat_kv`` order),
which keeps each rank's query heads with their own key/value heads. With fewer key/value heads
than ranks (``g < t``, ``t`` a multiple of ``g``) rank ``r`` holds the one head ``r // (t/g)`` its
query heads use, replicated over those ``t/g`` ranks (layout ``groups=(a, g, g)``); the head's
gradient is summed over exactly them in backward, inside the column layer.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn

from ..distributed.collectives import group_size
from ..distributed.context import ContextParallel
from ..distributed.rng import RNGStreams
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..recompute import checkpoint, replayable_sdpa, stream_sdpa
from .config import GPTConfig
from .qk_norm import QKNorm
from .context_attention import context_attention
from .modes import resolve_attention
from .rope import RopeTables, RotaryEmbedding

# scaled_dot_product_attention(..., enable_gqa=True) exists from PyTorch 2.5
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def causal_bias(s: int, r: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[r*s, s]``: ``r`` copies of the ``[s, s]`` causal mask (-inf above the diagonal)."""
    return torch.full((s, s), float("-inf"), dtype=dtype, device=device).triu_(1).repeat(r, 1)


class CoreAttention(nn.Module):
    """softmax(QK^T / sqrt(d) + causal mask) -> dropout -> times V, for this rank's heads.

    q ``[s, b, a/t, d]``, k and v ``[s, b, g/t, d]`` -> ``[s, b, a/t * d]``. This is the part that
    selective recomputation recomputes: in bf16 it keeps ``5as^2b/t`` bytes (softmax output, 1-byte
    dropout mask, dropout output) for ``4bs^2h/t`` FLOPs. Grouped-query attention never expands K
    and V: the ``r = a/g`` query heads of a group are folded into the rows of one batched matmul,
    ``[b*g, r*s, d] x [b*g, d, s]``.
    """

    def __init__(self, config: GPTConfig, streams: RNGStreams):
        super().__init__()
        self.p, self.setting, self.streams = config.attention_dropout, config.attention, streams
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self._bias, self._bias_key = None, None

    def _causal_bias(self, s: int, r: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``[r*s, s]``: ``r`` copies of the ``[s, s]`` mask with -inf above the diagonal; cached."""
        key = (s, r, dtype, device)
        if self._bias_key != key:
            self._bias = causal_bias(s, r, dtype, device)
            self._bias_key = key
        return self._bias

    def kernel(self, device: torch.device) -> str:
        """``"math"`` or ``"sdpa"``: ``model.attention`` on ``device`` (``auto``: sdpa on CUDA only)."""
        return resolve_attention(self.setting, device)

    def prepare(self, bias: torch.Tensor, r: int) -> None:
        """Hold ``bias`` (:func:`causal_bias` at the model's sequence length, shared by every layer)
        as a non-persistent buffer before compiling: created in the traced region, the cache would
        be a side effect, and a buffer is not taken for an activation when a compiled graph keeps it."""
        s = bias.shape[1]
        self.register_buffer("causal_bias_table", bias, persistent=False)
        self._bias, self._bias_key = bias, (s, r, bias.dtype, bias.device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s, b, a, d = q.shape
        g = k.shape[2]
        r = a // g  # query heads per key/value head
        p = self.p if self.training else 0.0
        if self.kernel(q.device) == "sdpa":
            return self._fused(q, k, v, p).permute(2, 0, 1, 3).reshape(s, b, a * d)  # [s, b, a/t * d]
        # copies, never views of the QKV buffer: a view (b = 1, or one key/value head) would keep
        # the whole buffer alive next to the copies, Q twice
        qb = q.permute(1, 2, 0, 3).reshape(b * g, r * s, d).contiguous()  # [b*g, r*s, d]: group's heads as rows
        kt = k.permute(1, 2, 3, 0).reshape(b * g, d, s).contiguous()      # [b*g, d, s]
        vb = v.permute(1, 2, 0, 3).reshape(b * g, s, d).contiguous()
        # one fused op: causal bias + scale * QK^T (the bias is a broadcast view, never saved)
        bias = self._causal_bias(s, r, q.dtype, q.device)
        scores = torch.baddbmm(bias.expand(b * g, r * s, s), qb, kt, alpha=self.scale)  # [b*g, r*s, s]
        # in the scores' dtype (bf16 stays bf16, accumulated in fp32 by the kernel): autocast would
        # upcast the output to fp32 and double the 2as^2b bytes Table 2 counts for it
        with torch.autocast(q.device.type, enabled=False):
            probs = torch.softmax(scores, dim=-1)
        if p > 0:  # each TP rank holds different heads: the per-rank stream; keeps a 1-byte mask
            probs = self.streams.dropout(probs, p, "tp", core=True)
        ctx = torch.bmm(probs, vb)                                     # [b*g, r*s, d]
        return ctx.view(b, a, s, d).permute(2, 0, 1, 3).reshape(s, b, a * d)  # [s, b, a/t * d]

    def _fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> torch.Tensor:
        """``scaled_dot_product_attention`` -> ``[b, a/t, s, d]``. Its dropout mask comes from the
        per-rank stream: eager, the kernel draws it from the default generator with the stream's
        state swapped in; compiled (where states cannot be swapped), one op takes the state and
        returns the next (:func:`~seqpar.recompute.stream_sdpa`), drawing the same mask."""
        r = q.shape[2] // k.shape[2]
        qh, kh, vh = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, heads, s, d] views
        if r > 1 and not _SDPA_GQA:  # old PyTorch: the kernel needs equal head counts
            kh, vh = kh.repeat_interleave(r, 1), vh.repeat_interleave(r, 1)
        gqa = r > 1 and _SDPA_GQA
        if p > 0 and torch.compiler.is_compiling():
            return stream_sdpa(qh, kh, vh, p, self.streams, "tp", enable_gqa=gqa)
        with self.streams.fork("tp") if p > 0 else contextlib.nullcontext():
            return replayable_sdpa(qh, kh, vh, dropout_p=p, is_causal=True, enable_gqa=gqa)


class SelfAttention(nn.Module):
    """``[s/t, b, h]`` (SP) or ``[s, b, h]`` -> same shape. QKV all-gathers the sequence under SP
    (inside the column layer), RoPE (``position="rope"``) rotates this rank's q and k heads on the
    full sequence, the projection reduce-scatters it back. Under context parallelism (``cp``) the
    sequence is this CP rank's ``s/cp`` tokens and attention exchanges K/V over cp
    (:mod:`seqpar.model.context_attention`, which keeps no ``s x s`` term in any recompute mode)."""

    def __init__(self, config: GPTConfig, tp_group, streams: RNGStreams, layer_std: tuple[float, float],
                 rope: RopeTables | None = None, cp: ContextParallel | None = None):
        super().__init__()
        t = self.t = group_size(tp_group)
        h, dt, sp = config.hidden, config.torch_dtype, config.sequence_parallel
        a, g, d = config.heads, config.num_kv_heads, config.head_dim
        std, out_std = layer_std
        kv_local = max(1, g // t)  # g < t: one head, shared with the t/g ranks using it
        self.local_heads, self.local_kv_heads, self.head_dim = a // t, kv_local, d
        self.streams = streams
        self.recompute = False  # set by the model for selective recomputation

        chunks = 3 if g == a else (a, g, g)
        groups = (a, g, g) if g < t else None  # declared only where heads are replicated
        self.qkv = ColumnParallelLinear(h, (a + 2 * g) * d, bias=config.bias, tp_group=tp_group, sequence_parallel=sp,
                                        dtype=dt, init_method=lambda w: nn.init.normal_(w, 0.0, std), chunks=chunks,
                                        groups=groups)
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.rope = None if rope is None else RotaryEmbedding(rope, a // t, kv_local, d, self.cp)
        self.qk_norm = QKNorm(a // t, kv_local, d, config.layernorm_eps, dt, t) if config.qk_norm else None
        self.core = CoreAttention(config, streams)
        self.proj = RowParallelLinear(h, h, bias=config.bias, tp_group=tp_group, sequence_parallel=sp, dtype=dt,
                                      init_method=lambda w: nn.init.normal_(w, 0.0, out_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)                                   # [s, b, (a+2g)/t * d] = [q_r | k_r | v_r]
        if self.qk_norm is not None:
            qkv = self.qk_norm(qkv)                         # Qwen3: q and k heads normalised before RoPE
        if self.rope is not None:
            qkv = self.rope(qkv)                            # a new buffer; the unrotated one is freed
        s, b = qkv.shape[:2]
        a, g, d = self.local_heads, self.local_kv_heads, self.head_dim
        q, k, v = qkv.split((a * d, g * d, g * d), dim=-1)
        q, k, v = q.view(s, b, a, d), k.view(s, b, g, d), v.view(s, b, g, d)  # views of one buffer
        if self.cp is not None:
            ctx = context_attention(q, k, v, self.cp, self.core.scale)
        elif self.recompute and not torch.compiler.is_compiling():  # compiled: the block's policy recomputes
            ctx = checkpoint(self.core, q, k, v, streams=self.streams)  # keeps only q, k, v
        else:
            ctx = self.core(q, k, v)
        return self.proj(ctx)                               # [s, b, h/t] -> [s/t, b, h] (SP)
