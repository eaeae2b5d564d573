"""Conversion between seqpar's GPT and other model formats (``transformers`` imported lazily)."""
from . import gpt2, llama

__all__ = ["gpt2", "llama"]
