"""The dry run's stand-in for routing: balanced token counts where the router's choice is a value.

An MoE layer (:mod:`seqpar.model.moe`) counts its tokens per expert (``torch.bincount`` of the
router's top-k ids) and, under expert parallelism, exchanges those counts over ep and reads them on
the host: the row all-to-all needs its split sizes (:func:`seqpar.distributed.expert_dispatch.dispatch`).
On fake tensors the ids have no values, so neither the counts nor the splits exist. The dry run
answers both as the planner assumes them (:mod:`seqpar.memory.moe`, :mod:`seqpar.plan.experts`):
balanced routing, every expert gets ``n k / E`` of a rank's ``n k`` assignments (the first
``n k mod E`` experts one more), and every peer routes as this rank does, so the counts a rank
receives over ep equal those it sends. The counts are real tensors (a few integers), so what is
computed from them alone (the split sizes, the grouped GEMM's offsets) runs for real; the rows
stay fake. A real router's load is uneven: a rank may receive more rows than the balanced ``n k``,
and the dry run does not guess how many.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

from ..errors import UserError

BINCOUNT = torch.ops.aten.bincount.default
ALL_TO_ALL = torch.ops.c10d.alltoall_base_.default


def check_routing(model) -> None:
    """Refuse what the stand-in cannot answer: a capacity factor drops assignments by their place in
    an expert's queue, a boolean mask of the router's values whose size no fake tensor knows."""
    moe = getattr(model, "moe", None)
    if moe is not None and moe.capacity_factor is not None:
        raise UserError(f"model.moe.capacity_factor={moe.capacity_factor:g}: a dry run cannot tell which assignments "
                        f"it drops (they depend on the router's values); dry-run the dropless model "
                        f"(model.moe.capacity_factor=null), the planner's assumption")


def balanced_counts(assignments: int, bins: int) -> torch.Tensor:
    """``[bins]`` int64: ``assignments`` spread evenly, the first ``assignments % bins`` bins one more."""
    base, extra = divmod(assignments, bins)
    counts = torch.full((bins,), base, dtype=torch.int64)
    counts[:extra] += 1
    return counts


def answer(func, args, kwargs) -> torch.Tensor | None:
    """The stand-in's result of ``func(*args, **kwargs)`` where routing makes it a value, else None:
    ``bincount`` of fake expert ids (balanced counts, real); the ``all_to_all`` of real counts over ep
    (what a rank receives is what it sends: every peer routes alike)."""
    kwargs = kwargs or {}
    if func is BINCOUNT and is_fake(args[0]) and kwargs.get("weights", args[1] if len(args) > 1 else None) is None:
        minlength = kwargs.get("minlength", args[2] if len(args) > 2 else 0)
        return balanced_counts(args[0].numel(), max(int(minlength), 1))
    return None


def mirror_counts(func, args) -> None:
    """After a real-tensor ``all_to_all`` ran on the fake process group (which moves nothing): its
    output holds what this rank sent, as though every peer routed alike."""
    if func is ALL_TO_ALL and not any(is_fake(x) for x in tree_leaves(args)):
        out, inp = args[0], args[1]
        if out.shape == inp.shape:
            out.copy_(inp)
