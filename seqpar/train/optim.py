"""AdamW with decoupled weight decay on matrices only, warmup + cosine LR, TP-aware clipping.

Weight decay applies to 2-D weights of linear layers. Norm weights, biases and embedding tables
(token and position) are excluded: decaying them pulls LayerNorm gains toward zero and rare
tokens' embeddings toward the origin without regularising anything useful.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, all_reduce, group_rank, group_size
from ..layers import VocabParallelEmbedding
from ..parallel.grads import replica_views
from ..sharding import local_tensor, split_parameters


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float]):
    """AdamW with two groups: decayed linear-layer matrices, and everything else undecayed."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    kind = {"fused": True} if on_cuda else {"foreach": True}  # fused: one kernel for all params on CUDA
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kind)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from lr/warmup to ``lr`` over ``warmup_steps``, then cosine to ``min_lr``.
    ``step`` counts from 0 (the first optimizer step)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def clip_grad_norm_tp(model: nn.Module, max_norm: float, tp_group: ProcessGroup | None,
                      shard_group: ProcessGroup | None = None) -> torch.Tensor:
    """Global gradient L2 norm of the *full* model, computed across TP: squares of split
    parameters (as their layouts declare, :mod:`seqpar.sharding`) are summed over the TP group;
    replicated parameters (identical on every TP rank after grad sync) are counted once. Scales
    the grads in place by ``min(1, max_norm / (norm + 1e-6))`` when ``max_norm > 0``. Returns the
    norm before clipping as a 0-dim tensor on the grads' device (identical on all ranks): per-tensor
    norms by ``torch._foreach_norm`` (at least fp32) and the scale applied on the device, so the
    step needs no host sync here. ``shard_group``: the group over which every gradient is sharded
    (FSDP's dp group; each rank holds another part of each tensor), whose squares are summed too.
    Pieces replicated over TP (grouped-query key/value heads at ``g < t``) count once."""
    sharded = split_parameters(model) if group_size(tp_group) > 1 else set()
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    grads = [local_tensor(p.grad.detach()) for p in params]
    views = replica_views(model, group_rank(tp_group), group_size(tp_group)) if sharded else {}
    parts = [(v, id(p) in sharded) for p, g in zip(params, grads) for v in views.get(id(p), [g])]
    acc = torch.promote_types(grads[0].dtype, torch.float32)
    norms = torch.stack(torch._foreach_norm([g if g.dtype == acc else g.to(acc) for g, _ in parts])) ** 2
    split = torch.tensor([float(s) for _, s in parts], dtype=norms.dtype, device=norms.device)
    sq = torch.stack([(norms * split).sum(), (norms * (1 - split)).sum()])  # [split, replicated]; no masks: no sync
    shard_sq = sq[0:1].clone()
    all_reduce(shard_sq, tp_group)
    total = (shard_sq + sq[1:2])
    all_reduce(total, shard_group)  # FSDP: every rank holds 1/dp of every tensor
    norm = total[0].sqrt()
    if max_norm > 0:
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].dtype))
    return norm
