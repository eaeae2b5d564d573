"""A GPT-2 / Llama-family decoder built from seqpar's parallel layers."""
from .attention import CoreAttention, SelfAttention
from .config import GPTConfig, RopeScaling
from .gpt import GPT, Block, Dropout
from .mlp import MLP, SwiGLU
from .norm import RMSNorm
from .rope import RotaryEmbedding

__all__ = ["GPTConfig", "RopeScaling", "GPT", "Block", "Dropout", "SelfAttention", "CoreAttention", "MLP", "SwiGLU",
           "RMSNorm", "RotaryEmbedding"]
