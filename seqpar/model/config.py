"""GPTConfig: the model's shape and its parallel / recompute modes, validated up front."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class GPTConfig:
    """A GPT-2/GPT-3 style decoder. Every check that needs only these numbers runs in
    ``validate()``; the ones that need the TP size run in ``check_parallel(t)``."""

    vocab_size: int = 50304        # divisible by t (pad the tokenizer's vocabulary if needed)
    seq_len: int = 1024            # maximum sequence length (learned position embeddings)
    hidden: int = 768              # h
    heads: int = 12                # a; h must be divisible by a
    layers: int = 12               # L
    ffn_hidden: int | None = None  # MLP width; None means 4 * hidden
    dropout: float = 0.1           # embedding, post-attention and post-MLP dropout
    attention_dropout: float = 0.1 # dropout on the attention probabilities
    activation: Literal["gelu", "gelu_tanh"] = "gelu"
    tie_embeddings: bool = True    # output head shares the token-embedding table
    layernorm_eps: float = 1e-5
    bias: bool = True              # biases in the linear layers (GPT-2 has them)
    init_std: float = 0.02         # normal init; residual output projections get std / sqrt(2L)
    sequence_parallel: bool = True # shard LayerNorm/dropout/residual along the sequence (needs t | seq)
    recompute: Literal["none", "selective", "full"] = "selective"
    recompute_method: Literal["uniform", "block"] = "uniform"  # full only: N-layer groups, or first N layers
    recompute_num_layers: int = 1  # N for full recompute
    attention: Literal["math", "sdpa"] = "math"  # sdpa: PyTorch's fused kernels
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"  # parameter/activation dtype

    def __post_init__(self) -> None:
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.hidden

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def validate(self) -> None:
        """Raise ``ValueError`` naming the values of any inconsistent field."""
        for name in ("vocab_size", "seq_len", "hidden", "heads", "layers", "ffn_hidden", "recompute_num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        for name in ("dropout", "attention_dropout"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"GPTConfig.{name} must be in [0, 1), got {p}")
        if not 0 < self.layernorm_eps < float("inf"):  # NaN fails too; 0 divides by zero on a constant row
            raise ValueError(f"GPTConfig.layernorm_eps must be a finite number > 0, got {self.layernorm_eps!r}")
        if not 0 <= self.init_std < float("inf"):
            raise ValueError(f"GPTConfig.init_std must be a finite number >= 0, got {self.init_std!r}")
        choices = {"activation": ("gelu", "gelu_tanh"), "recompute": ("none", "selective", "full"),
                   "recompute_method": ("uniform", "block"), "attention": ("math", "sdpa"), "dtype": tuple(DTYPES)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.recompute == "full" and self.recompute_num_layers > self.layers:
            raise ValueError(f"GPTConfig.recompute_num_layers ({self.recompute_num_layers}) exceeds layers "
                             f"({self.layers})")

    def check_parallel(self, t: int) -> None:
        """Every dimension that TP/SP splits must be divisible by ``t``; raised on every rank
        before any collective, with all offending values in one message."""
        self.validate()
        bad = [f"{name} ({getattr(self, name)})" for name in ("heads", "hidden", "ffn_hidden", "vocab_size")
               if getattr(self, name) % t]
        if self.sequence_parallel and self.seq_len % t:
            bad.append(f"seq_len ({self.seq_len}, sequence parallelism)")
        if bad:
            raise ValueError(f"GPTConfig: not divisible by the tensor-parallel size t={t}: {', '.join(bad)}")
