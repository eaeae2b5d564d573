"""The plain-PyTorch peer: a GPT written the way a user writes one, one device, no seqpar inside.

nanoGPT's shape in today's PyTorch, batch-first ``[b, s, h]``: ``nn.Linear`` layers with a fused
``[q; k; v]`` projection, ``F.layer_norm``, ``F.scaled_dot_product_attention(is_causal=True)``
(PyTorch picks flash / memory-efficient / cuDNN on CUDA), a GeLU MLP of 4h, dropout after the
embeddings, on the attention probabilities and after each block's output projection, the LM head
tied to the token embedding and ``F.cross_entropy`` on fp32 logits. Optional per-block
``Module.compile()`` (torchtitan's way) and full recompute by ``torch.utils.checkpoint``; AdamW fused
on CUDA, foreach elsewhere. It is seqpar's GPT-2-style GPT (pre-LN, learned positions, biases,
LayerNorm eps 1e-5), so its parameters, FLOPs and, with the same weights and no dropout, its loss
equal seqpar's at ``t = 1`` (``tests/test_side_by_side.py``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .peer import BenchShape, copy_dense

PLAIN_RECOMPUTE = ("none", "full")  # a user's choices: keep everything, or checkpoint each block


class LayerNorm(nn.Module):
    """``F.layer_norm`` over the last dimension with weight and bias."""

    def __init__(self, h: int, dtype: torch.dtype, eps: float = 1e-5):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(h, dtype=dtype)), nn.Parameter(torch.zeros(h, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class SelfAttention(nn.Module):
    """``[b, s, h]`` -> ``[b, s, h]``: fused QKV, causal SDPA over ``a`` heads, output projection."""

    def __init__(self, h: int, heads: int, dropout: float, dtype: torch.dtype):
        super().__init__()
        self.qkv, self.proj = nn.Linear(h, 3 * h, dtype=dtype), nn.Linear(h, h, dtype=dtype)
        self.heads, self.dropout = heads, dropout
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)                                     # 3 x [b, s, h]
        q, k, v = (y.view(b, s, self.heads, h // self.heads).transpose(1, 2) for y in (q, k, v))  # [b, a, s, d]
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)))


class MLP(nn.Module):
    def __init__(self, h: int, f: int, dropout: float, dtype: torch.dtype):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f, dtype=dtype), nn.Linear(f, h, dtype=dtype)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc2(F.gelu(self.fc1(x))))


class Block(nn.Module):
    def __init__(self, shape: BenchShape, dropout: float, dtype: torch.dtype):
        super().__init__()
        h = shape.hidden
        self.ln1, self.ln2 = LayerNorm(h, dtype), LayerNorm(h, dtype)
        self.attn = SelfAttention(h, shape.heads, dropout, dtype)
        self.mlp = MLP(h, shape.ffn_hidden, dropout, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class UserGPT(nn.Module):
    """Tokens ``[b, s]`` (and labels) -> mean cross-entropy. ``recompute``: ``none`` or ``full``
    (each block checkpointed by ``torch.utils.checkpoint``, non-reentrant)."""

    def __init__(self, shape: BenchShape, *, dropout: float = 0.0, recompute: str = "none",
                 device: str | torch.device = "cpu"):
        super().__init__()
        if recompute not in PLAIN_RECOMPUTE:
            raise ValueError(f"the plain peer recomputes {PLAIN_RECOMPUTE} (what a user writes with "
                             f"torch.utils.checkpoint), got recompute={recompute!r}")
        dt, h = getattr(torch, shape.dtype), shape.hidden
        with torch.device(device):  # built and initialised where it runs
            self.wte = nn.Embedding(shape.vocab_size, h, dtype=dt)
            self.wpe = nn.Embedding(shape.seq_len, h, dtype=dt)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block(shape, dropout, dt) for _ in range(shape.layers))
            self.ln_f = LayerNorm(h, dt)
            self.apply(_init_weights)
        self.recompute = recompute

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(s, device=tokens.device)))  # [b, s, h]
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute == "full" else block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)                                    # [b, s, v], tied head
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())

    def compile_blocks(self, backend: str = "inductor") -> None:
        """``torch.compile`` each block in place (one graph per block shape, shared by all blocks)."""
        for block in self.blocks:
            block.compile(backend=backend)

    def load_dense(self, state: dict[str, torch.Tensor]) -> None:
        """Copy seqpar's dense state dict (``GPT.dense_state_dict``: ``blocks.{i}.attn.qkv`` rows
        ``[q; k; v]``, as here) into this model; its names are this model's names."""
        copy_dense(self, state)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, 0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def user_adamw(model: nn.Module, *, lr: float = 1e-4, weight_decay: float = 0.1) -> torch.optim.AdamW:
    """AdamW as a user sets it up: matrices decayed, vectors not; fused on CUDA, foreach elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    kind = {"fused": True} if params[0].is_cuda else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **kind)


class PlainPeer:
    """:class:`UserGPT` as a ``seqpar bench`` peer: one rank only (``--tp 1``), dropout 0."""

    name = "plain"

    def build(self, shape: BenchShape, dense_state: dict[str, torch.Tensor], *, tp_group, tp_rank: int,
              tp_size: int, recompute: str, sequence_parallel: bool = True) -> None:
        if tp_size != 1:
            raise ValueError(f"the plain peer runs on one device (tp 1), got tp_size={tp_size}")
        self.model = UserGPT(shape, recompute=recompute)
        self.model.load_dense(dense_state)
        self.optimizer = user_adamw(self.model, weight_decay=0.0)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        loss = self.model(tokens, labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def saved_bytes_per_layer(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        from ...memory import ActivationLedger
        with ActivationLedger(self.model, layer_pattern=r"blocks\.\d+") as ledger:
            loss = self.model(tokens, labels)
        del loss
        return sum(ledger.per_layer().values()) / len(self.model.blocks)
