"""The collectives of one training step, by kind, group and bytes, and whether a layer issued them.

Two sources, one table (:class:`StepComm`):

* seqpar's own collectives (:mod:`seqpar.distributed.collectives`: the paper's g / g-bar, the
  cross-entropy's all-reduces, gradient sums, the clip) are recorded by what they compute
  (``reduce_scatter`` even where gloo runs it as an all-to-all);
* every other ``torch.distributed`` operation (FSDP2's gathers and reduce-scatters, the pipeline
  schedule's sends and receives, DDP's buckets) is seen at the dispatcher, as the ``c10d`` operator
  it runs (:class:`RawCollectives`), except the operators seqpar's collectives issue right after
  recording themselves: each tells how many it issues, and :class:`StepComm` skips that many.

Bytes follow :class:`~seqpar.distributed.comm_counter.CommCounter`: the full tensor a collective
operates on (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor, what a send
sends). :class:`LayerScope` tells which collectives a transformer layer issued, forward (module
hooks) and backward (hooks on the gradients of the layer's output and input), so the per-layer
volume can be set next to §4.2.2's.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..distributed.collectives import ProcessGroup, world_group
from ..distributed.comm_counter import CommCounter, c10d_collective, count_comm
from ..distributed.mesh import ParallelMesh
from ..model.gpt import Block


def group_names(mesh: ParallelMesh, extra: dict[str, ProcessGroup | None] | None = None) -> dict[str, str]:
    """``group_name -> label`` for the mesh's groups (tp, cp, dp, pp, dp x cp: ``cp`` at dp = 1; ep
    and edp under expert parallelism), ``extra`` ones and the world (a group the mesh names keeps the mesh's name)."""
    groups = dict(extra or {})  # the mesh's own names win for the same group (p = 2: the tied pair is pp)
    if mesh.cp_size > 1 and mesh.dp_size > 1:
        groups["dp x cp"] = mesh.dp_cp_mesh.get_group()
    if mesh.ep_size > 1:  # expert parallelism: the all-to-alls' group, the experts' gradient sums' (edp)
        groups.update({"ep": mesh.ep_group, "edp": mesh.edp_group})
    groups.update({"tp": mesh.tp_group, "cp": mesh.cp_group, "dp": mesh.dp_group, "pp": mesh.pp_group})
    out = {g.group_name: name for name, g in groups.items() if g is not None}
    if mesh.cp_size > 1 and mesh.dp_size == 1:  # FSDP2's and DDP's dp x cp group: the cp ranks, another name
        out.setdefault(mesh.dp_cp_mesh.get_group().group_name, "cp")
    world = world_group()
    if world is not None:
        out.setdefault(world.group_name, "world")
    return out


class LayerScope:
    """Whether the running operation belongs to a transformer layer (:class:`~seqpar.model.gpt.Block`)
    of ``module``: inside a layer's forward, or between the gradient of its output and that of its
    input in backward. Hooks only; nothing is saved."""

    def __init__(self, module: nn.Module):
        self.depth = 0
        self._inputs: dict[int, torch.Tensor | None] = {}  # id(layer) -> its input, during its forward
        self._handles = []
        for m in module.modules():
            if isinstance(m, Block):
                self._handles.append(m.register_forward_pre_hook(self._enter_forward))
                self._handles.append(m.register_forward_hook(self._leave_forward, always_call=True))

    @property
    def inside(self) -> bool:
        return self.depth > 0

    def _step(self, by: int):
        def hook(grad):
            self.depth += by
        return hook

    def _enter_forward(self, module, args):
        self.depth += 1
        x = args[0] if args and torch.is_tensor(args[0]) else None
        self._inputs[id(module)] = x if x is not None and x.requires_grad else None

    def _leave_forward(self, module, args, out):
        self.depth -= 1
        x = self._inputs.pop(id(module), None)
        if x is not None and torch.is_tensor(out) and out.requires_grad:
            out.register_hook(self._step(+1))  # its backward starts
            x.register_hook(self._step(-1))    # and ends with its input's gradient

    def close(self) -> None:
        for h in self._handles:
            h.remove()


class StepComm(CommCounter):
    """Collectives by ``(group label, kind)``: ``rows`` of ``[calls, bytes]``, and ``in_layers``, the
    part transformer layers issued (when a :class:`LayerScope` is attached). ``pending``: the
    ``torch.distributed`` operators seqpar's collectives announced (:meth:`record`) and
    :meth:`observe` has not seen yet."""

    def __init__(self, names: dict[str, str]):
        super().__init__()
        self.names = names
        self.rows: dict[tuple[str, str], list[int]] = {}
        self.in_layers: dict[tuple[str, str], list[int]] = {}
        self.scope: LayerScope | None = None
        self.pending = 0

    def label(self, group: ProcessGroup | None) -> str:
        if group is None:
            return "world"
        return self.names.get(group.group_name, f"{group.size()} ranks")

    def add(self, kind: str, nbytes: int, group: ProcessGroup | None = None) -> None:
        super().add(kind, nbytes, group)
        key = (self.label(group), kind)
        for table in (self.rows, self.in_layers) if self.scope is not None and self.scope.inside else (self.rows,):
            row = table.setdefault(key, [0, 0])
            row[0] += 1
            row[1] += nbytes

    def record(self, kind: str, nbytes: int, group: ProcessGroup | None, ops: int) -> None:
        super().record(kind, nbytes, group, ops)
        self.pending += ops

    def observe(self, func, args) -> None:
        """Count ``func(*args)``, seen at the dispatcher, when it is a ``c10d`` operator that seqpar's
        collectives did not announce (each announces its operators right before issuing them)."""
        seen = c10d_collective(func, args)
        if seen is None:
            return
        if self.pending > 0:
            self.pending -= 1
            return
        self.add(*seen)

    def table(self) -> list[dict]:
        """One dict per ``(group, kind)``: calls and bytes of the step, and of them inside layers."""
        return [{"group": g, "kind": k, "calls": c, "bytes": n, "layer_calls": self.in_layers.get((g, k), [0, 0])[0],
                 "layer_bytes": self.in_layers.get((g, k), [0, 0])[1]} for (g, k), (c, n) in sorted(self.rows.items())]


class RawCollectives(TorchDispatchMode):
    """Counts the ``c10d`` operators that seqpar's collectives did not issue into ``comm`` (on real
    tensors; a dry run's fake-tensor mode counts them itself)."""

    def __init__(self, comm: StepComm):
        super().__init__()
        self.comm = comm

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.comm.observe(func, args)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_step(module: nn.Module, names: dict[str, str], *, raw: bool = True) -> Iterator[StepComm]:
    """Inside the block, every collective of ``module``'s training step into a :class:`StepComm`;
    ``raw=False`` leaves the ``c10d`` operators to the caller (:meth:`StepComm.observe`)."""
    comm = StepComm(names)
    comm.scope = LayerScope(module)
    try:
        with count_comm(comm), RawCollectives(comm) if raw else contextlib.nullcontext():
            yield comm
    finally:
        comm.scope.close()


__all__ = ["LayerScope", "RawCollectives", "StepComm", "group_names", "record_step"]
