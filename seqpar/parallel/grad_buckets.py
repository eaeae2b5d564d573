"""The bf16 recipe's fp32 gradients under ddp, reduced over dp in buckets while backward runs.

The fp32 masters' ``.grad`` are views into a few flat fp32 buffers (buckets of about
``parallel.bucket_mib``, parameters in reverse order, roughly the order backward produces their
gradients), so reducing a bucket needs no copy. Each bf16 compute copy's gradient is added into
its master's view the moment autograd accumulates it (a post-accumulate-grad hook), and during
the step's last micro-batch a bucket whose parameters all have their gradient is all-reduced at
once, asynchronously, under the rest of backward. Buckets are launched strictly in bucket order
(a bucket that fills early waits for the ones before it), so every dp rank issues the same
collectives in the same order. :meth:`GradBuckets.finish` launches what is left (parameters that
got no gradient this step keep zeros), waits, and divides by the dp size. With context
parallelism the group is dp x cp: each CP rank's gradient is its tokens' share of one sequence's,
so one all-reduce over dp x cp sums the shares over cp and, divided by dp only, averages over dp.
"""
from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn as nn

from ..distributed.collectives import all_reduce, group_size

DEFAULT_BUCKET_MIB = 25.0


class GradBuckets:
    """Bucketed, overlapped all-reduce of ``model``'s fp32 gradients over ``group`` (dp, or dp x cp),
    divided by ``divide_by`` (default: the group's size, a mean)."""

    def __init__(self, model: nn.Module, group, bucket_mib: float = DEFAULT_BUCKET_MIB,
                 divide_by: int | None = None, names: Collection[str] | None = None, skip: Collection[str] = ()):
        """``names``: only these parameters (default: every trainable one); ``skip``: not these
        (expert weights go in buckets of their own, over the expert-data-parallel group)."""
        if not bucket_mib > 0:
            raise ValueError(f"parallel.bucket_mib must be > 0, got {bucket_mib}")
        self.model, self.group = model, group
        self.size = group_size(group) if divide_by is None else divide_by
        named = [(n, p) for n, p in model.named_parameters()
                 if p.requires_grad and (names is None or n in names) and n not in skip]
        limit = max(1, int(bucket_mib * 2**20) // 4)  # fp32 elements per bucket
        groups: list[list[tuple[str, nn.Parameter]]] = [[]]
        for name, p in reversed(named):
            if groups[-1] and sum(q.numel() for _, q in groups[-1]) + p.numel() > limit:
                groups.append([])
            groups[-1].append((name, p))
        device = named[0][1].device if named else torch.device("cpu")
        self.buffers = [torch.zeros(sum(p.numel() for _, p in g), dtype=torch.float32, device=device) for g in groups]
        self._slots: dict[str, tuple[int, torch.Tensor]] = {}  # name -> (bucket, view of its buffer)
        for b, group_params in enumerate(groups):
            offset = 0
            for name, p in group_params:
                self._slots[name] = (b, self.buffers[b][offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        self._counts = [len(g) for g in groups]
        self._hooks: list = []
        self._pending: list[int] = []
        self._works: list = []
        self._next, self._last = 0, False

    def begin(self, weights: dict[str, torch.Tensor]) -> None:
        """Start an optimizer step whose micro-batches compute on ``weights`` (the bf16 copies):
        zero the buckets, point every master's ``.grad`` at its view, hook the copies."""
        for buf in self.buffers:
            buf.zero_()
        params = dict(self.model.named_parameters())
        for name, (_, view) in self._slots.items():
            params[name].grad = view
            self._hooks.append(weights[name].register_post_accumulate_grad_hook(self._hook(name)))
        self._pending, self._works, self._next, self._last = list(self._counts), [], 0, False

    def last_micro_batch(self) -> None:
        """The next backward is the step's last: buckets are reduced as they fill."""
        self._last = True

    def _hook(self, name: str):
        bucket, view = self._slots[name]

        def add_into_master(weight: torch.Tensor) -> None:
            view.add_(weight.grad)
            weight.grad = None
            if self._last:
                self._pending[bucket] -= 1
                self._launch(ready_only=True)
        return add_into_master

    def _launch(self, *, ready_only: bool) -> None:
        while self._next < len(self.buffers) and (not ready_only or self._pending[self._next] == 0):
            work = all_reduce(self.buffers[self._next], self.group, async_op=True)
            if work is not None:
                self._works.append(work)
            self._next += 1

    def finish(self) -> None:
        """After the last backward: reduce the remaining buckets, wait for all, divide (average over dp)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._launch(ready_only=False)
        for work in self._works:
            work.wait()
        self._works = []
        if self.size > 1:
            torch._foreach_div_(self.buffers, float(self.size))


__all__ = ["DEFAULT_BUCKET_MIB", "GradBuckets"]
