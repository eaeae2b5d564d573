"""Cross-entropy over vocabulary-parallel logits, without ever gathering the full vocabulary."""
from __future__ import annotations

from typing import Literal

import torch

from ..distributed.collectives import ProcessGroup, ReduceOp, all_reduce, check_group, group_rank, group_size

# Logits a pass over the logits takes at once: the forward and backward walk the tokens in chunks of
# about this many, through one reused fp32 buffer (16 MiB, which stays in an A100's or H100's L2
# cache), so no fp32 [tokens, v/t] copy ever exists. Each chunk costs a few kernel launches: at 2^20 a
# 1.3B GPT's step (8192 tokens, v = 50304) took about 410 chunks per pass; at 2^22 it takes 103.
CHUNK_ELEMENTS = 1 << 22
ELSEWHERE, IGNORED = -1, -2  # target codes: the target id is on another rank's shard / ignore_index


def _chunks(tokens: int, width: int) -> list[slice]:
    """Row ranges of ``[tokens, width]`` of about :data:`CHUNK_ELEMENTS` elements each."""
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return [slice(i, min(i + step, tokens)) for i in range(0, tokens, step)]


def _target_codes(targets: torch.Tensor, start: int, local_v: int, ignore_index: int) -> torch.Tensor:
    """``[tokens]`` int32: the target's column in this shard, :data:`ELSEWHERE` or :data:`IGNORED`."""
    local = targets - start
    on = (local >= 0) & (local < local_v)
    code = torch.where(on, local, torch.full_like(local, ELSEWHERE))
    return code.masked_fill(targets == ignore_index, IGNORED).to(torch.int32)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from logits ``[..., v/t]`` sharded by vocabulary over TP (online log-sum-exp).

    Forward: the max over this shard in the logits' dtype, all-reduced (MAX); then, a chunk of
    tokens at a time in fp32 (fp64 stays fp64), the sum of exp(logit - max), the target logit and
    (with label smoothing) the sum of logits, all-reduced (SUM) in one call: two small all-reduces
    of ``[tokens]``-shaped tensors instead of an all-gather of ``[..., v]``. Saves the logits as
    they are (their dtype: ``2sbv/t`` bytes in bf16), the per-token log-sum-exp ``[tokens]`` in
    fp32 and the target codes ``[tokens]`` int32: 8 bytes per token beyond the logits.
    Backward: local, no communication; recomputes the softmax exp(logit - lse) chunk by chunk and
    writes ``(softmax - onehot) * grad`` in the logits' dtype.
    Columns at or past ``vocab`` (padding of the table to a multiple of t) count as -inf logits:
    softmax 0, no gradient, not in the label-smoothing average.
    """

    @staticmethod
    def forward(ctx, logits, targets, group, ignore_index, label_smoothing, vocab):
        local_v = logits.shape[-1]
        start = group_rank(group) * local_v
        valid = min(max(vocab - start, 0), local_v)  # this rank's real columns: a prefix of its shard
        calc = torch.promote_types(logits.dtype, torch.float32)  # fp32 at least
        x = logits.reshape(-1, local_v)  # [tokens, v/t], a view of the logits
        code = _target_codes(targets.reshape(-1), start, local_v, ignore_index)
        lmax = x[:, :valid].amax(dim=-1).to(calc) if valid else x.new_full(x.shape[:1], float("-inf"), dtype=calc)
        all_reduce(lmax, group, op=ReduceOp.MAX)
        on = code >= 0
        target = x.gather(-1, code.clamp(min=0).long().unsqueeze(-1)).squeeze(-1) - lmax
        sums = torch.zeros(3 if label_smoothing > 0 else 2, x.shape[0], dtype=calc, device=x.device)
        sums[0] = target.masked_fill(~on, 0.0)
        chunks = _chunks(x.shape[0], valid)
        work = x.new_empty((chunks[0].stop, valid), dtype=calc) if chunks else None  # the one fp32 buffer
        for rows in chunks:
            shifted = torch.sub(x[rows, :valid], lmax[rows].unsqueeze(-1), out=work[:rows.stop - rows.start])
            if label_smoothing > 0:
                torch.sum(shifted, dim=-1, out=sums[2, rows])
            torch.sum(shifted.exp_(), dim=-1, out=sums[1, rows])
        all_reduce(sums, group)  # target logit, sum of exp (, sum of logits) in one call
        log_z = sums[1].log()
        loss = log_z - sums[0]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - sums[2] / vocab)
        loss = loss.masked_fill(code == IGNORED, 0.0)
        ctx.save_for_backward(logits, lmax.add_(log_z), code)  # lmax becomes the log-sum-exp
        ctx.label_smoothing, ctx.vocab, ctx.valid = label_smoothing, vocab, valid
        return loss.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, code = ctx.saved_tensors
        local_v, smoothing, valid = logits.shape[-1], ctx.label_smoothing, ctx.valid
        x = logits.reshape(-1, local_v)
        scale = grad_loss.reshape(-1).to(lse.dtype).masked_fill(code == IGNORED, 0.0)
        on_target = (code >= 0).to(lse.dtype) * -(1.0 - smoothing)
        index = code.clamp(min=0).long()
        grad = torch.empty_like(x)
        chunks = _chunks(x.shape[0], local_v)
        direct = grad.dtype == lse.dtype  # fp32 / fp64 logits: computed in place in the gradient
        work = None if direct or not chunks else x.new_empty((chunks[0].stop, local_v), dtype=lse.dtype)
        for rows in chunks:
            p = grad[rows] if direct else work[:rows.stop - rows.start]
            torch.sub(x[rows], lse[rows].unsqueeze(-1), out=p)
            if valid < local_v:
                p[:, valid:] = float("-inf")
            p.exp_()  # the softmax, recomputed
            if smoothing > 0:
                p[:, :valid].sub_(smoothing / ctx.vocab)
            p.scatter_add_(-1, index[rows].unsqueeze(-1), on_target[rows].unsqueeze(-1))
            p.mul_(scale[rows].unsqueeze(-1))
            if not direct:
                grad[rows] = p  # written in the logits' dtype
        return grad.view(logits.shape), None, None, None, None, None


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
