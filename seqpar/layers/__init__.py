"""Tensor-parallel layers; sequence parallelism is a mode of each (``sequence_parallel=True``).

Each layer declares its parameters' layouts (``param_layouts()``, see :mod:`seqpar.sharding`).
"""
from .cross_entropy import vocab_parallel_cross_entropy
from ._init import skip_init
from .embedding import VocabParallelEmbedding
from .functional import column_parallel_linear, row_parallel_linear
from .linear import ColumnParallelLinear, RowParallelLinear

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "column_parallel_linear",
           "row_parallel_linear", "skip_init", "vocab_parallel_cross_entropy"]
