"""A GPT-style transformer built from seqpar's parallel layers."""
from .attention import CoreAttention, SelfAttention
from .config import GPTConfig
from .gpt import GPT, Block, Dropout
from .mlp import MLP

__all__ = ["GPTConfig", "GPT", "Block", "Dropout", "SelfAttention", "CoreAttention", "MLP"]
