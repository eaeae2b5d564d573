"""Time forward+backward of the vocabulary-parallel cross-entropy on one CPU rank, and count the bytes it
saves for backward: the online log-sum-exp (seqpar's) against the softmax-saving one it replaced.

    python scripts/bench/cross_entropy.py [--tokens 1024 --vocab 8192 --repeats 15]

Both run on the same logits, interleaved round by round so machine drift hits both alike; the table
shows the median time per forward+backward and the saved bytes (the ledger's count), each with the
ratio new / old. A last line gives the largest loss and gradient difference of the two at fp64.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from seqpar.layers import vocab_parallel_cross_entropy
from seqpar.memory import ActivationLedger


class _SoftmaxSavingCE(torch.autograd.Function):
    """The cross-entropy before the online one, for comparison (t = 1, no padding, no smoothing):
    casts the logits to fp32, saves the fp32 softmax [tokens, v] and the target masks."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))
        x = x - x.amax(dim=-1, keepdim=True)
        ignored = targets == ignore_index
        local_t = targets.masked_fill(ignored, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(ignored, 0.0)
        exp = x.exp_()
        sum_exp = exp.sum(dim=-1)
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_t, ignored)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        grad, local_t, ignored = ctx.saved_tensors
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -(~ignored).to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss.to(grad.dtype) * (~ignored)).unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None


def _old(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return _SoftmaxSavingCE.apply(logits, targets, -100).sum()


def _new(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, targets, tp_group=None, reduction="sum")


class _Loss(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, logits, targets):
        return self.fn(logits, targets)


def _step(fn, logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Seconds of one forward+backward, the loss and the logits' gradient."""
    x = logits.detach().requires_grad_()
    start = time.perf_counter()
    loss = fn(x, targets)
    loss.backward()
    return time.perf_counter() - start, loss.detach(), x.grad


def _saved(fn, logits: torch.Tensor, targets: torch.Tensor) -> int:
    module = _Loss(fn)
    with ActivationLedger(module) as ledger:
        module(logits.detach().requires_grad_(), targets)
    return ledger.total()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=8192, help="this rank's columns (v/t)")
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    torch.manual_seed(0)
    targets = torch.randint(0, args.vocab, (args.tokens,))
    targets[::17] = -100
    print(f"tokens={args.tokens} v/t={args.vocab} threads={torch.get_num_threads()} repeats={args.repeats}\n")
    print("| logits | old ms | new ms | new / old | old saved MiB | new saved MiB | new / old |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in (torch.float32, torch.bfloat16):
        logits = (3 * torch.randn(args.tokens, args.vocab)).to(dtype)
        times = {"old": [], "new": []}
        for _ in range(args.repeats):
            for name, fn in (("old", _old), ("new", _new)):
                times[name].append(_step(fn, logits, targets)[0])
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        saved = {"old": _saved(_old, logits, targets), "new": _saved(_new, logits, targets)}
        mib = {k: v / 2**20 for k, v in saved.items()}
        print(f"| {str(dtype).replace('torch.', '')} | {med['old']:.2f} | {med['new']:.2f} | "
              f"{med['new'] / med['old']:.2f}x | {mib['old']:.2f} | {mib['new']:.2f} | "
              f"{saved['new'] / saved['old']:.2f}x |")
    logits = 3 * torch.randn(args.tokens, args.vocab, dtype=torch.float64)
    (_, lo, go), (_, ln, gn) = _step(_old, logits, targets), _step(_new, logits, targets)
    print(f"\nfp64: |loss new - old| = {float((ln - lo).abs()):.2e}, max |grad new - old| = "
          f"{float((gn - go).abs().max()):.2e}")


if __name__ == "__main__":
    main()
