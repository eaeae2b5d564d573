"""Op-level recompute choices (``model.recompute_ops``): what a layer stops keeping once a fused
attention kernel has made the paper's selective recompute moot.

The paper's rule -- recompute what holds the most bytes per FLOP -- applied to the rest of a layer's
``34sbh``. Each choice drops Table 2 terms (:data:`DROPPED_TERMS`) in a layer whose mode is ``none``
or ``selective`` and recomputes them in backward from what the layer keeps anyway:

* ``norm``: the two norm outputs (the QKV and fc1 inputs, ``4sbh``); rebuilt from the norm's input
  (which the norm's own backward keeps) by running the norm again, no grad, same weights.
* ``activation``: the activation-function output (the fc2 input, ``2sbf``: ``8sbh`` for GeLU at
  ``f = 4h``); rebuilt from the fc1 output, which GeLU / SwiGLU keep for their own backward.
* ``dropout``: the post-attention and post-MLP dropout masks (``2sbh`` at one byte each); redrawn
  in backward from the stream's generator state before the draw
  (:func:`seqpar.distributed.rng.redrawn_dropout`).

The first two are one mechanism, :func:`recompute_output`: ``consumer(producer(x))`` where every
tensor ``consumer`` saves of ``producer(x)``'s storage is packed as a recipe instead (the saved
view's size, stride and offset) and rebuilt by ``producer(x)`` when backward unpacks it. Other
saved tensors pass through to the enclosing ``saved_tensors_hooks`` (the memory ledger's), so the
ledger sees exactly what is still kept. The rebuilt values are bit-identical: the same
deterministic op on the same input, weights and autocast state. A compiled block traces no hooks:
its checkpoint policy recomputes LayerNorm and GeLU instead (:func:`seqpar.recompute.rebuilt_ops`).
"""
from __future__ import annotations

from typing import Callable, Literal, Sequence, get_args

import torch
from torch import Tensor

RecomputeOp = Literal["norm", "activation", "dropout"]  # what a none / selective layer also recomputes
RECOMPUTE_OPS: tuple[RecomputeOp, ...] = get_args(RecomputeOp)

# the Table 2 terms (seqpar.memory.formulas names) each choice stops keeping
DROPPED_TERMS: dict[str, tuple[str, ...]] = {
    "norm": ("qkv_input", "fc1_input"),
    "activation": ("fc2_input",),
    "dropout": ("attn_dropout_mask", "mlp_dropout_mask"),
}


def check_recompute_ops(ops: Sequence[str], key: str = "model.recompute_ops") -> tuple[str, ...]:
    """``ops`` as a tuple, or :class:`ValueError` naming an unknown or repeated value."""
    if isinstance(ops, str) or not isinstance(ops, (list, tuple)):
        raise ValueError(f"{key} must be a list of {list(RECOMPUTE_OPS)}, got {ops!r}")
    unknown = [o for o in ops if o not in RECOMPUTE_OPS]
    if unknown:
        raise ValueError(f"{key} has unknown value(s) {unknown}; choose from {list(RECOMPUTE_OPS)}")
    repeated = sorted({o for o in ops if list(ops).count(o) > 1})
    if repeated:
        raise ValueError(f"{key} names {repeated} more than once: {list(ops)}")
    return tuple(ops)


def _storage_id(t: Tensor) -> int:
    """What identifies ``t``'s storage while it lives (views share it; fake tensors too)."""
    return t.untyped_storage()._cdata


class _Recipe:
    """What a saved view of the rebuilt tensor is kept as: how to rebuild it, and the view (its
    size, stride and offset from the rebuilt tensor's first element)."""

    __slots__ = ("rebuild", "size", "stride", "offset")

    def __init__(self, rebuild: Callable[[], Tensor], t: Tensor, base_offset: int):
        self.rebuild, self.size, self.stride = rebuild, t.size(), t.stride()
        self.offset = t.storage_offset() - base_offset

    def tensor(self) -> Tensor:
        out = self.rebuild()
        return out.as_strided(self.size, self.stride, out.storage_offset() + self.offset)


class _RebuildSaved(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks packing views of ``target``'s storage as :class:`_Recipe`; everything else
    goes to the hooks that were active when entered (or is kept as it is)."""

    def __init__(self, target: Tensor, rebuild: Callable[[], Tensor]):
        self.key, self.base, self.rebuild = _storage_id(target), target.storage_offset(), rebuild
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        super().__init__(self._pack, self._unpack)

    def _pack(self, t: Tensor):
        if _storage_id(t) == self.key and t.untyped_storage().nbytes() > 0:
            return _Recipe(self.rebuild, t, self.base)
        return (False, self.outer[0](t) if self.outer else t)

    def _unpack(self, packed):
        if isinstance(packed, _Recipe):
            return packed.tensor()
        return self.outer[1](packed[1]) if self.outer else packed[1]


def _autocast_cast(y: Tensor) -> tuple[Tensor, torch.dtype | None]:
    """``y`` in autocast's dtype when autocast is on (what a following linear layer would save)."""
    dev = y.device.type
    if torch.is_autocast_enabled(dev) and y.is_floating_point() and y.dtype != torch.get_autocast_dtype(dev):
        dt = torch.get_autocast_dtype(dev)
        return y.to(dt), dt
    return y, None


def recompute_output(producer: Callable[[Tensor], Tensor], x: Tensor, consumer: Callable[[Tensor], Tensor]) -> Tensor:
    """``consumer(producer(x))``, keeping none of ``producer(x)``'s bytes that ``consumer`` saves for
    backward: they are rebuilt by running ``producer(x)`` again (no grad, the forward's autocast
    state) when backward needs them. ``producer`` must be deterministic and keep ``x`` itself for
    its own backward (a norm, GeLU, SwiGLU), so rebuilding costs no bytes. Under autocast the
    output is cast to autocast's dtype first (as the consuming linear layer would)."""
    y = producer(x)
    if not torch.is_grad_enabled() or not y.requires_grad or torch.compiler.is_compiling():
        return consumer(y)
    y, cast = _autocast_cast(y)
    dev = x.device.type
    ac = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
    kept = x.detach()

    def rebuild() -> Tensor:
        with torch.no_grad(), torch.autocast(dev, dtype=ac[1], enabled=ac[0]):
            out = producer(kept)
            return out if cast is None else out.to(cast)

    with _RebuildSaved(y, rebuild):
        return consumer(y)


__all__ = ["DROPPED_TERMS", "RECOMPUTE_OPS", "RecomputeOp", "check_recompute_ops", "recompute_output"]
