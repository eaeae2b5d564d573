"""AdamW with decoupled weight decay on matrices only, and the warmup + cosine LR schedule.

The global-norm clip of every layout is :func:`seqpar.parallel.grads.clip_grad_norm`.

Weight decay applies to 2-D weights of linear layers. Norm weights, biases and embedding tables
(token and position) are excluded: decaying them pulls LayerNorm gains toward zero and rare
tokens' embeddings toward the origin without regularising anything useful.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..layers import VocabParallelEmbedding


def build_optimizer(model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    fused: bool | None = None):
    """AdamW with two groups: decayed linear-layer matrices, and everything else undecayed.

    ``fused`` (default: on CUDA) picks the fused kernel, one launch for every parameter, which
    also skips a non-finite step from a device flag (``found_inf``, :mod:`seqpar.train.step`);
    otherwise the foreach implementation. The CPU keeps foreach: torch's fused CPU kernel rounds
    differently in the last bit, so runs and checkpoints would change, and on the CPU the host
    read that foreach's skip needs waits on no device."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Embedding, VocabParallelEmbedding))}
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embeddings else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if fused is None:
        fused = any(p.is_cuda for p in decay + no_decay)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kind)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """Linear warmup from lr/warmup to ``lr`` over ``warmup_steps``, then cosine to ``min_lr``.
    ``step`` counts from 0 (the first optimizer step)."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
