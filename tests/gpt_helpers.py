"""Shared helpers for GPT tests."""
import torch

from seqpar.distributed import ParallelMesh, sync_sp_replicated_grads
from seqpar.model import GPT, GPTConfig


def tiny_config(**kw) -> GPTConfig:
    base = dict(vocab_size=64, seq_len=16, hidden=32, heads=4, layers=3, dropout=0.0, attention_dropout=0.0,
                recompute="none", sequence_parallel=True)
    base.update(kw)
    return GPTConfig(**base)


def mesh_for(group) -> ParallelMesh:
    """A mesh whose TP group is ``group`` (tests build groups directly)."""
    return ParallelMesh.for_tp_group(group)


def batch(cfg: GPTConfig, b: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)
    return tokens, labels


def loss_and_dense_grads(model: GPT, tokens, labels):
    """Loss, then every gradient in the dense layout (SP-replicated grads synced first)."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    loss.backward()
    sync_sp_replicated_grads(model, model.tp_group)
    return loss.detach(), model.to_dense({n: p.grad for n, p in model.named_parameters()})
