"""Count the host reads of a training step from outside: every read of a tensor's values into Python.

On CUDA each such read waits for the device's queue to empty (a host sync); on the CPU nothing
waits, but the reads are the same calls, so :class:`HostReads` counts them on either device:
``aten._local_scalar_dense`` (what ``.item()``, ``float()``, ``int()`` and ``bool()`` of a tensor
dispatch) through a dispatch mode, and ``Tensor.tolist`` / ``Tensor.numpy`` (which read CPU memory
without dispatching anything) through a function mode. The token-id range guards that read on the
CPU only (:data:`CPU_ONLY_GUARDS`; on CUDA an asynchronous device assertion, or checked when the
data is opened) look at the input batch, not at a result, and are not counted.
"""
from __future__ import annotations

import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

CPU_ONLY_GUARDS = {"check_token_ids", "_check_range", "check_targets"}


def _in_cpu_guard() -> bool:
    """Whether a seqpar function of :data:`CPU_ONLY_GUARDS` is on the current stack."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in CPU_ONLY_GUARDS and "seqpar" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class _ScalarReads(TorchDispatchMode):
    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not _in_cpu_guard():
            self.reads.append("_local_scalar_dense")
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    """``with HostReads() as counter: ...``: ``counter.reads`` lists the reads made inside, in order
    (``"_local_scalar_dense"``, ``"tolist"`` or ``"numpy"``)."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self._dispatch = _ScalarReads(self.reads)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and not _in_cpu_guard():
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> HostReads:
        self._dispatch.__enter__()
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        self._dispatch.__exit__(*exc)


__all__ = ["CPU_ONLY_GUARDS", "HostReads"]
