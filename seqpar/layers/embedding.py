"""Vocabulary-parallel embedding: the ``[v, h]`` table split by rows over TP."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..distributed.collectives import ProcessGroup, check_divisible, check_group, group_rank, group_size
from ..distributed.regions import reduce_from_tp, reduce_scatter_to_sp
from ..sharding import ParamLayout, shard, unshard
from ._init import InitMethod, build_param, skip_init


class VocabParallelEmbedding(nn.Module):
    """Rank ``r`` holds rows ``[r*v/t, (r+1)*v/t)`` of the table.

    Input ids ``[s, b]`` (identical on all TP ranks). Ids owned by other ranks look up zeros
    here; the partial results are summed over TP: all-reduced to ``[s, b, h]`` (plain TP) or
    reduce-scattered straight into sequence shards ``[s/t, b, h]`` (SP). ``seq_dim`` is the
    sequence dim of the ids (and of the SP output): 0 for sequence-first ``[s, b]`` (the default),
    1 for batch-first ``[b, s]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None, device=None,
                 init_method: InitMethod | None = None, per_shard_init: bool = False, seq_dim: int = 0):
        super().__init__()
        check_group(tp_group, "VocabParallelEmbedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size, self.tp_rank = tp_group, group_size(tp_group), group_rank(tp_group)
        check_divisible(num_embeddings, self.tp_size, "VocabParallelEmbedding num_embeddings (vocabulary size)")
        self.sequence_parallel, self.seq_dim = bool(sequence_parallel), seq_dim
        self.num_local = num_embeddings // self.tp_size
        self.vocab_start = self.tp_rank * self.num_local
        self.weight = build_param((num_embeddings, embedding_dim), ParamLayout(split_dim=0), self.tp_rank, self.tp_size,
                                  init_method or nn.init.normal_, dtype=dtype, device=device,
                                  per_shard_init=per_shard_init)

    def param_layouts(self) -> dict[str, ParamLayout]:
        return {"weight": ParamLayout(split_dim=0)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"VocabParallelEmbedding: ids must be int64/int32, got {ids.dtype}")
        if self.sequence_parallel and self.tp_size > 1 and ids.shape[self.seq_dim] % self.tp_size:
            raise ValueError(f"VocabParallelEmbedding: the sequence dim seq_dim={self.seq_dim} of ids "
                             f"{tuple(ids.shape)} ({ids.shape[self.seq_dim]}) is not divisible by the "
                             f"tensor-parallel size t={self.tp_size}")
        self._check_range(ids)
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.num_local)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(partial, self.tp_group, self.seq_dim)  # -> [s/t, b, h]
        return reduce_from_tp(partial, self.tp_group)

    def _check_range(self, ids: torch.Tensor) -> None:
        """Ids outside the vocabulary would look up zeros on every rank (a silently wrong result).
        Eager on CPU: a ``ValueError`` with the range found. Under ``torch.compile`` or on a GPU: a
        device-side assertion, which needs no host sync and breaks no graph."""
        if torch.compiler.is_compiling() or ids.device.type != "cpu":
            torch._assert_async(((ids >= 0) & (ids < self.num_embeddings)).all(),
                                f"VocabParallelEmbedding: ids must lie in [0, {self.num_embeddings})")
        elif ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise ValueError(f"VocabParallelEmbedding: ids must lie in [0, {self.num_embeddings}), "
                             f"got min {int(ids.min())} max {int(ids.max())}")

    def load_dense(self, weight: torch.Tensor) -> None:
        if tuple(weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"VocabParallelEmbedding: full weight must have shape "
                             f"{(self.num_embeddings, self.embedding_dim)}, got {tuple(weight.shape)}")
        with torch.no_grad():
            self.weight.copy_(shard(weight, self.param_layouts()["weight"], self.tp_rank, self.tp_size))

    def dense_weight(self) -> torch.Tensor:
        """The full ``[v, h]`` table, all-gathered over TP (a collective: call on every rank)."""
        return unshard(self.weight, self.param_layouts()["weight"], self.tp_group)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, *, tp_group: ProcessGroup | None, sequence_parallel: bool = False, **kw):
        layer = cls(emb.num_embeddings, emb.embedding_dim, tp_group=tp_group, sequence_parallel=sequence_parallel,
                    dtype=emb.weight.dtype, device=emb.weight.device, init_method=skip_init, **kw)
        layer.load_dense(emb.weight.detach())
        return layer

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"local_rows=[{self.vocab_start}, {self.vocab_start + self.num_local}), tp_rank={self.tp_rank}, "
                f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}"
                + (f", seq_dim={self.seq_dim}" if self.sequence_parallel else ""))
