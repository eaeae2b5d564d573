"""seqpar's own GPT as a benchmark peer."""
from __future__ import annotations

import torch

from ...distributed.grad_sync import sync_sp_replicated_grads
from ...distributed.mesh import ParallelMesh
from ...memory.ledger import ActivationLedger
from ...model import GPT, GPTConfig
from .peer import BenchShape, Recompute


def gpt_config(shape: BenchShape, recompute: Recompute, sequence_parallel: bool = True) -> GPTConfig:
    """The benchmark shape as a seqpar GPTConfig (``shape.dropout``, math attention, tied embeddings)."""
    return GPTConfig(vocab_size=shape.vocab_size, seq_len=shape.seq_len, hidden=shape.hidden, heads=shape.heads,
                     layers=shape.layers, dropout=shape.dropout, attention_dropout=shape.dropout,
                     sequence_parallel=sequence_parallel, recompute=recompute, dtype=shape.dtype, attention="math")


class SeqparPeer:
    name = "seqpar"

    def build(self, shape, dense_state, *, tp_group, tp_rank, tp_size, recompute, sequence_parallel=True):
        self.model = GPT(gpt_config(shape, recompute, sequence_parallel), ParallelMesh.for_tp_group(tp_group))
        self.model.load_dense_state_dict(dense_state)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.0)

    def step(self, tokens, labels) -> float:
        loss = self.model(tokens, labels)
        loss.backward()
        sync_sp_replicated_grads(self.model, self.model.tp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def saved_bytes_per_layer(self, tokens, labels) -> float:
        with ActivationLedger(self.model) as ledger:
            loss = self.model(tokens, labels)
        del loss
        per_layer = ledger.per_layer()
        return sum(per_layer.values()) / len(per_layer)


class OverlapPeer(SeqparPeer):
    """seqpar with ``parallel.tp_overlap``: SP gathers and reduce-scatters in per-rank chunks under the GEMMs."""
    name = "seqpar-overlap"

    def build(self, *args, **kwargs):
        super().build(*args, **kwargs)
        from ...parallel.apply import apply_tp_overlap
        apply_tp_overlap(self.model, True)


class CompiledPeer(SeqparPeer):
    """seqpar with ``train.compile``: every block compiled by Inductor (compiled at the step-0 call)."""
    name = "seqpar-compiled"

    def build(self, *args, **kwargs):
        super().build(*args, **kwargs)
        from ...parallel.compile import compile_blocks
        compile_blocks(self.model)

    def saved_bytes_per_layer(self, tokens, labels) -> float:
        self.model(tokens, labels).backward()  # compile first (no optimizer step): the ledger reads the graphs' saves
        self.model.zero_grad(set_to_none=True)
        return super().saved_bytes_per_layer(tokens, labels)
