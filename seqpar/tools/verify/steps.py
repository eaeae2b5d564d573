"""One layout's few training steps on this rank, for seqpar's own GPT or a drop-in model.

Both kinds of run expose the same three calls to :func:`train_steps`: ``forward_backward`` over
this rank's micro-batches (gradients reduced over every group), ``clip`` (the global gradient
norm, not clipped), and ``parts`` (the modules whose parameters this rank holds, under the
full model's names). After each step's backward every gradient is turned into its dense,
layout-free form on this rank (FSDP shards gathered with ``full_tensor``, TP shards with the
layout's all-gather), so rank 0 can compare each rank's copy with the one-process run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ...distributed.layouts import param_layouts
from ...sharding import unshard

LR = 0.1          # plain SGD: a step moves the weights without amplifying rounding (AdamW would)
GLOBAL_BATCH = 4  # sequences per optimizer step, whatever the layout
MICRO_BATCH = 2   # sequences per micro-batch (seqpar's GPT; drop-in runs take the rank's share at once)


@dataclass
class StepsResult:
    """What one rank saw: per step the mean loss over the world, the global norm, its dense grads."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # parameters that got no gradient
    loss_dtype: str = "float64"  # the dtype the model computed its loss in (HF upcasts logits to fp32)


def global_batch(vocab: int, seq_len: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s tokens and next-token labels, ``[GLOBAL_BATCH, seq_len]`` each, from the seed only."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    ids = torch.randint(0, vocab, (GLOBAL_BATCH, seq_len + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def rank_batches(tokens: torch.Tensor, labels: torch.Tensor, dp_rank: int, dp: int, micro: int) -> list:
    """This dp rank's rows of the global batch, as micro-batches of ``micro`` rows."""
    rows = tokens.shape[0] // dp
    lo = dp_rank * rows
    x, y = tokens[lo:lo + rows], labels[lo:lo + rows]
    return [(x[i:i + micro], y[i:i + micro]) for i in range(0, rows, micro)]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's dp shard) gathered to the full local tensor; other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def dense_grads(parts: list[nn.Module], tp_group) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Every parameter's gradient in ``parts``, dense (collectives over dp for FSDP2 and over TP);
    and the names of the parameters that have no gradient."""
    out, missing = {}, []
    for part in parts:
        layouts = param_layouts(part)
        for name, p in part.named_parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                missing.append(name)
                continue
            out[name] = unshard(_full(p.grad).detach(), layouts[name], tp_group).to("cpu", copy=True)
    return out, missing


def train_steps(run, batches_of, steps: int, tp_group, world_mean) -> StepsResult:
    """``steps`` SGD steps of ``run`` (module docstring); ``batches_of(step)``: this rank's micro-batches;
    ``world_mean(x)``: the mean of a float64 scalar over the world."""
    params = [p for part in run.parts for p in part.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=LR)
    out = StepsResult()
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = run.forward_backward(batches_of(step))
        grads, missing = dense_grads(run.parts, tp_group)
        norm = run.clip()
        out.loss_dtype = str(loss.dtype).removeprefix("torch.")
        out.losses.append(float(world_mean(loss.detach().double())))
        out.norms.append(float(norm))
        out.grads.append(grads)
        out.missing = sorted(set(out.missing) | set(missing))
        opt.step()
    return out


__all__ = ["GLOBAL_BATCH", "LR", "MICRO_BATCH", "StepsResult", "dense_grads", "global_batch", "rank_batches",
           "train_steps"]
