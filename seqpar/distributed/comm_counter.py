"""The byte counter: calls and bytes of every collective seqpar issues inside a :func:`count_comm` block.

seqpar's collectives (:mod:`~seqpar.distributed.collectives`, :mod:`~seqpar.distributed.transfers`)
report each one here (:func:`record`) by what it computes, right before issuing its
``torch.distributed`` operators: a reduce-scatter is a ``reduce_scatter`` even where gloo runs it as
an all-to-all. Bytes are the full (unsharded) tensor a collective operates on, of which a ring
algorithm moves ``(t-1)/t`` per rank: the all-gather's output, the reduce-scatter's input, the
all-reduce's tensor, what a point-to-point step sends.

The open counters are a context variable, set and reset by :func:`count_comm` (no module-level
list: nested blocks, threads and asyncio tasks each see their own). Autograd runs a CUDA backward
on its own device threads, which do not share the caller's context; the engine stashes the
caller's context for them at ``backward()`` and :func:`open_counters` reads it there (releases
that stash it, 2.13 among them; on older ones a CUDA backward's collectives go uncounted).
:func:`c10d_collective` reads the same figures off a ``torch.distributed`` operator seen at the
dispatcher, for tools that watch the operators seqpar does not issue itself (``seqpar.tools``).
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


@dataclass
class CommCounter:
    """Calls and payload bytes per collective kind while open (:func:`count_comm`)."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int, group: ProcessGroup | None = None) -> None:
        """One collective of ``kind`` over ``group`` on a tensor of ``nbytes`` (module docstring)."""
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def record(self, kind: str, nbytes: int, group: ProcessGroup | None, ops: int) -> None:
        """A seqpar collective about to be issued as ``ops`` ``torch.distributed`` operators: counted
        by :meth:`add` (a counter that also watches the operators uses ``ops`` to tell them apart)."""
        self.add(kind, nbytes, group)

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def wire_bytes(self, t: int) -> float:
        """Bytes each rank sends with ring algorithms: ``(t-1)/t`` of an all-gather's or a
        reduce-scatter's full tensor, ``2(t-1)/t`` of an all-reduce's (a reduce-scatter then an
        all-gather), and all of a point-to-point send's (``send_recv``, counted at the sender)."""
        factor = {"all_gather": (t - 1) / t, "reduce_scatter": (t - 1) / t, "all_reduce": 2.0 * (t - 1) / t,
                  "send_recv": 1.0, "all_to_all": (t - 1) / t}  # all-to-all: evenly routed tokens
        return sum(factor[k] * n for k, n in self.bytes.items())


_OPEN: ContextVar[tuple[CommCounter, ...]] = ContextVar("seqpar_comm_counters", default=())


@contextmanager
def count_comm(counter: CommCounter | None = None) -> Iterator[CommCounter]:
    """Count every seqpar collective issued inside the block (forward and backward) into
    ``counter`` when given (a subclass may keep more, e.g. the group), else into a new one."""
    counter = CommCounter() if counter is None else counter
    token = _OPEN.set((*_OPEN.get(), counter))
    try:
        yield counter
    finally:
        _OPEN.reset(token)


def open_counters() -> tuple[CommCounter, ...]:
    """The counters open here: this context's, or on an autograd device thread the caller's."""
    counters = _OPEN.get()
    if counters or not getattr(torch._C, "_is_key_in_tls", lambda key: False)("context"):
        return counters
    stashed = torch._C._get_obj_in_tls("context")  # the context autograd stashed at backward()
    return stashed.get(_OPEN, ()) if stashed is not None else ()


def record(kind: str, t: torch.Tensor, group: ProcessGroup | None, ops: int = 1) -> None:
    """Count one collective of ``kind`` on ``t`` over ``group``, issued next as ``ops`` operators."""
    if torch.compiler.is_compiling():  # a compiled graph's collectives are read off the graph
        return
    for counter in open_counters():
        counter.record(kind, t.numel() * t.element_size(), group, ops)


# c10d operator -> (kind, index of the argument whose tensors count): the same bytes as record()
C10D_OPS: dict[str, tuple[str, int]] = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0), "allgather_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1), "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1), "broadcast_": ("broadcast", 0), "send": ("send", 0), "recv_": ("recv", 0),
    "barrier": ("barrier", 0), "reduce_": ("reduce", 0), "gather_": ("gather", 1), "scatter_": ("scatter", 0),
}


def _nbytes(x) -> int:
    if torch.is_tensor(x):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def c10d_collective(func, args) -> tuple[str, int, ProcessGroup | None] | None:
    """``(kind, bytes, group)`` of an operator seen at the dispatcher when it is a ``torch.distributed``
    (``c10d``) one, else None; the bytes counted as :func:`record` counts them."""
    if func.namespace != "c10d":
        return None
    name = func._schema.name.split("::")[-1]
    kind, index = C10D_OPS.get(name, (name, 0))
    group = next((ProcessGroup.unbox(a) for a in args if isinstance(a, torch.ScriptObject)
                  and "ProcessGroup" in str(a._type())), None)
    return kind, _nbytes(args[index]) if index < len(args) else 0, group


__all__ = ["C10D_OPS", "CommCounter", "c10d_collective", "count_comm", "open_counters", "record"]
