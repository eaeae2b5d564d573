"""Cross-entropy over vocabulary-parallel logits, without ever gathering the full vocabulary."""
from __future__ import annotations

from typing import Literal

import torch

from ..distributed.collectives import ProcessGroup, ReduceOp, all_reduce, check_group, group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from logits ``[..., v/t]`` sharded by vocabulary over TP.

    Forward, in fp32: three small all-reduces of ``[...]``-shaped tensors (max, target logit,
    sum of exp; a fourth, sum of logits, with label smoothing) instead of an all-gather of
    ``[..., v]``. Saves the local softmax ``[..., v/t]`` in fp32 (fp64 stays fp64) (the paper's 4sbv/t term).
    Backward: local, no communication; it reuses the saved softmax in place.
    Columns at or past ``vocab`` (padding of the table to a multiple of t) count as -inf logits:
    softmax 0, no gradient, not in the label-smoothing average.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index, label_smoothing, vocab):
        local_v = logits.shape[-1]
        start = group_rank(group) * local_v
        valid = min(max(vocab - start, 0), local_v)  # this rank's real columns: a prefix of its shard
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least
        lmax = x[..., :valid].amax(dim=-1) if valid else x.new_full(x.shape[:-1], float("-inf"))
        all_reduce(lmax, group, op=ReduceOp.MAX)
        x = x - lmax.unsqueeze(-1)
        if valid < local_v:
            x[..., valid:] = float("-inf")
        ignored = targets == ignore_index
        elsewhere = (targets < start) | (targets >= start + local_v) | ignored
        local_t = (targets - start).masked_fill(elsewhere, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
        sum_logits = x[..., :valid].sum(dim=-1) if label_smoothing > 0 else None
        # one all-reduce for the target logit and (optionally) the logit sum
        stacked = torch.stack([target_logit] + ([sum_logits] if sum_logits is not None else []))
        all_reduce(stacked, group)
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        all_reduce(sum_exp, group)
        log_z = sum_exp.log()
        loss = log_z - stacked[0]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - stacked[1] / vocab)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, elsewhere, ignored)
        ctx.label_smoothing, ctx.vocab, ctx.valid, ctx.in_dtype = label_smoothing, vocab, valid, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, elsewhere, ignored = ctx.saved_tensors
        grad = softmax  # reused in place: this graph can be differentiated once
        on_target = (~elsewhere).to(grad.dtype) * (1.0 - ctx.label_smoothing)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -on_target.unsqueeze(-1))
        if ctx.label_smoothing > 0:
            grad[..., :ctx.valid].sub_(ctx.label_smoothing / ctx.vocab)
        grad.mul_((grad_loss.to(grad.dtype) * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None, None, None


def check_targets(targets: torch.Tensor, vocab: int, ignore_index: int = -100) -> None:
    """Raise ``ValueError`` naming the first target id outside ``[0, vocab)`` (``ignore_index``
    allowed). One host sync: call where a batch is made, not per layer, on GPUs."""
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        first = int(targets[bad][0])
        raise ValueError(f"target id {first} is outside the vocabulary [0, {vocab}) ({int(bad.sum())} such "
                         f"targets; ignore_index={ignore_index})")


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, *,
                                 tp_group: ProcessGroup | None, ignore_index: int = -100,
                                 label_smoothing: float = 0.0,
                                 reduction: Literal["mean", "sum", "none"] = "mean",
                                 vocab_size: int | None = None) -> torch.Tensor:
    """Cross-entropy of ``local_logits`` ``[..., v/t]`` (this rank's vocabulary shard) against
    ``targets`` ``[...]`` (full vocabulary ids, identical on all TP ranks).

    ``vocab_size``: the true vocabulary when the table is padded (``v/t`` x t rows hold
    ``vocab_size`` real ones first, then padding): the padded columns are masked to -inf, so the
    result equals the cross-entropy over the first ``vocab_size`` columns. None: no padding.

    Matches ``F.cross_entropy(full_logits, targets, ignore_index=..., label_smoothing=...)``:
    ``"mean"`` averages over non-ignored tokens (0 when all are ignored), ``"none"`` returns the
    per-token losses (0 at ignored positions). Computed in fp32. The result is identical on all
    TP ranks. A target outside ``[0, v)`` other than ``ignore_index`` raises ``ValueError`` (checked
    here for CPU tensors; CUDA callers check once per batch with :func:`check_targets`).
    """
    check_group(tp_group, "vocab_parallel_cross_entropy")
    if tuple(local_logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"vocab_parallel_cross_entropy: logits shape {tuple(local_logits.shape)} does not match "
                         f"targets shape {tuple(targets.shape)} (expected logits [*targets.shape, v/t])")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    padded = local_logits.shape[-1] * group_size(tp_group)
    vocab = padded if vocab_size is None else vocab_size
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= padded:
        raise ValueError(f"vocab_size must be an int in [1, {padded}] (the logits' {padded} columns over TP), "
                         f"got {vocab_size!r}")
    if targets.device.type == "cpu" and not torch.compiler.is_compiling():  # CUDA: checked where batches are made
        check_targets(targets, vocab, ignore_index)
    losses = _VocabParallelCrossEntropy.apply(local_logits, targets, tp_group, ignore_index, float(label_smoothing),
                                              vocab)
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    count = (targets != ignore_index).sum().clamp(min=1)
    return losses.sum() / count
