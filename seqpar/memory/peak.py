"""Peak saved-activation bytes of a pipeline rank during a schedule step (micro-batches in flight).

:class:`PeakActivationLedger` is an :class:`~seqpar.memory.ledger.ActivationLedger` that also
follows each saved tensor's lifetime: a storage counts from the first time autograd saves it until
the last graph node holding it is freed (after that micro-batch's backward), so the peak is what
the schedule keeps at once. The prediction it is checked against is
:func:`seqpar.memory.schedule.layers_in_flight` (§4.2.3).
"""
from __future__ import annotations

import weakref

import torch

from .ledger import ActivationLedger, _is_generator_state, _local


class _Held:
    """What the pack hook hands autograd: the saved tensor, and a lifetime to watch."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(x):
    return x.tensor if isinstance(x, _Held) else x


class PeakActivationLedger(ActivationLedger):
    """Context manager: ``peak_layer_bytes`` (inside transformer layers, what Table 2 counts)
    and ``peak_bytes`` (everything saved) of the live saved activations of ``model``, and
    ``outside_at_layer_peak`` (the most saved outside the layers while those are at their peak:
    §4.3's terms).

    >>> with PeakActivationLedger(pipe.module) as ledger:
    ...     pipe.step(tokens, labels)
    >>> ledger.peak_layer_bytes
    """

    def __init__(self, model: torch.nn.Module, *, during_backward: bool = True, **kwargs) -> None:
        """``during_backward=False`` leaves out what a recompute saves while backward runs (the
        transient of one recomputed unit, which Table 2 and §4.2.3 do not count)."""
        super().__init__(model, **kwargs)
        self._during_backward = during_backward
        self._live: dict[int, list] = {}  # storage ptr -> [holders, bytes, inside a layer]
        self.live_bytes = self.live_layer_bytes = self.peak_bytes = self.peak_layer_bytes = 0
        self.outside_at_layer_peak = 0  # the most bytes saved outside the layers while those are at their peak

    def __enter__(self) -> "PeakActivationLedger":
        super().__enter__()
        self._saved_hooks.__exit__(None, None, None)  # the parent's identity unpack: replaced by ours
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._saved_hooks.__enter__()
        return self

    def _layer_of(self, ptr: int) -> str | None:
        module = self._stack[-1] if self._stack else ""
        m = self._layer_re.match(module)
        return m.group(1) if m else self.layer_input(ptr)

    def _pack(self, saved: torch.Tensor):
        if not self._during_backward and torch._C._current_graph_task_id() != -1:  # a recompute's transient
            return saved
        t = _local(saved)
        ptr, nbytes = self._ptr(t), t.untyped_storage().nbytes()
        if ptr in self._skip or nbytes == 0 or _is_generator_state(t):  # bookkeeping, as the parent leaves out
            return saved
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [0, nbytes, self._layer_of(ptr) is not None]
            self._count(nbytes, entry[2])
        entry[0] += 1
        held = _Held(saved)
        weakref.finalize(held, self._release, ptr)
        return held

    def _count(self, nbytes: int, in_layer: bool) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if in_layer:
            self.live_layer_bytes += nbytes
        if self.live_layer_bytes >= self.peak_layer_bytes:  # at the layer peak: the most saved outside them
            outside = self.live_bytes - self.live_layer_bytes
            same = self.live_layer_bytes == self.peak_layer_bytes
            self.outside_at_layer_peak = max(self.outside_at_layer_peak, outside) if same else outside
            self.peak_layer_bytes = self.live_layer_bytes

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[ptr]
            self.live_bytes -= entry[1]
            if entry[2]:
                self.live_layer_bytes -= entry[1]


__all__ = ["PeakActivationLedger"]
