"""Tensor-parallel layers; sequence parallelism is a mode of each (``sequence_parallel=True``)."""
from .cross_entropy import vocab_parallel_cross_entropy
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy"]
