"""The shapes the planner reads from a ``GPTConfig``, for the GPT-2 and the Llama families alike.

Grouped-query attention (``g`` key/value heads of dim ``d``) narrows the QKV projection to
``h + 2gd`` columns; SwiGLU's fc1 is the fused gate and up projection, ``2f`` columns; the
vocabulary is padded to a multiple of ``vocab_multiple x t``; RMSNorm has no bias; RoPE has no
position table. Configs without these fields are GPT-2 style.
"""
from __future__ import annotations

from ..model.config import GPTConfig


def kv_heads(model: GPTConfig) -> int:
    """g: key/value heads (``heads`` without grouped-query attention)."""
    return getattr(model, "num_kv_heads", model.heads)


def qkv_width(model: GPTConfig) -> int:
    """Output columns of the fused QKV projection, all TP ranks together: h + 2 g d."""
    return model.hidden + 2 * kv_heads(model) * model.head_dim


def swiglu(model: GPTConfig) -> bool:
    return getattr(model, "mlp", "gelu") == "swiglu"


def fc1_width(model: GPTConfig) -> int:
    """Output columns of the first MLP projection: 2f for SwiGLU (gate and up), else f."""
    return (2 if swiglu(model) else 1) * model.ffn_hidden


def vocab_rows(model: GPTConfig, t: int) -> int:
    """Rows of the embedding and output matrices at TP size ``t`` (padded where the config pads)."""
    pad = getattr(model, "padded_vocab", None)
    return pad(t) if pad is not None else model.vocab_size


def learned_positions(model: GPTConfig) -> bool:
    return getattr(model, "position", "learned") == "learned"


def norm_params(model: GPTConfig) -> int:
    """Parameters of one normalisation layer: weight, plus bias for a biased LayerNorm."""
    layernorm = getattr(model, "norm", "layernorm") == "layernorm"
    return model.hidden * (2 if (layernorm and model.bias) else 1)


def layer_forward_flops(model: GPTConfig, b: int) -> tuple[float, float]:
    """(dense, attention core) forward FLOPs of one whole layer for ``b`` sequences (Appendix A:
    24bsh^2 and 4bs^2h for GPT-3's shapes)."""
    s, h = model.seq_len, model.hidden
    dense = 2.0 * s * b * h * (qkv_width(model) + h + fc1_width(model) + model.ffn_hidden)
    return dense, 4.0 * b * s * s * h


def model_key(model: GPTConfig) -> tuple:
    """The fields the planner reads, as a hashable key for its caches."""
    return (model.seq_len, model.hidden, model.heads, model.ffn_hidden, model.layers, model.vocab_size,
            model.dropout, model.attention_dropout, model.bias, model.tie_embeddings, kv_heads(model),
            swiglu(model), vocab_rows(model, 1), learned_positions(model), norm_params(model))
