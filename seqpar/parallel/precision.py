"""Numeric precision of training: fp32, the paper's bf16 recipe, or bf16 autocast.

``train.precision``:

* ``fp32``: parameters, activations and gradients in fp32.
* ``bf16`` (the paper's recipe): the model's parameters are the fp32 *master* weights the
  optimizer updates (AdamW states fp32 too). Once per optimizer step they are cast to bf16 leaf
  tensors, and every micro-batch runs on those (:meth:`Precision.weights_in`): activations,
  the residual stream, LayerNorm inputs and the recompute inputs are bf16, as Table 2 counts
  them. Each micro-batch's bf16 gradients are added into the fp32 ``.grad`` of the master
  weights, so accumulation over micro-batches and the data-parallel reduction run in fp32.
* ``bf16-autocast``: ``torch.autocast`` over fp32 parameters (bf16 matmuls; fp32 residual stream
  and norms, so ~1.3x Table 2's activation bytes).
* ``auto``: ``bf16`` on CUDA, ``fp32`` on CPU.

In every bf16 mode the attention softmax reads bf16 scores, accumulates in fp32 and writes a
bf16 output (see :class:`seqpar.model.attention.CoreAttention`).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

from ..errors import UserError
from ..model.modes import PRECISION_SETTINGS


def resolve_precision(name: str, device: torch.device) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere; other names are returned as given."""
    if name not in PRECISION_SETTINGS:
        raise ValueError(f"train.precision must be one of {PRECISION_SETTINGS}, got {name!r}")
    if name == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return name


class Precision:
    """How a training step runs its forward and backward in one precision mode."""

    def __init__(self, name: str, device: torch.device, *, fsdp: bool = False):
        self.name = resolve_precision(name, device)
        self.device = torch.device(device)
        self.fsdp = fsdp  # FSDP2 casts the gathered parameters itself (MixedPrecisionPolicy)

    @property
    def master_weights(self) -> bool:
        """True when the model's parameters are fp32 masters and compute runs on bf16 copies made
        here (under FSDP2 the bf16 copies are its gathered parameters instead)."""
        return self.name == "bf16" and not self.fsdp

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element that the memory formulas should count."""
        return 4 if self.name == "fp32" else 2

    def check_model(self, model: nn.Module) -> None:
        """The bf16 recipe needs fp32 master parameters (``model.dtype: float32``)."""
        if self.name == "bf16":
            bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
            if bad:
                raise UserError(f"train.precision=bf16 keeps fp32 master weights and computes in bf16: build the "
                                f"model in float32 (model.dtype), got parameters of dtype {bad}")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.name == "bf16-autocast":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def compute_weights(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """bf16 leaf copies of the parameters for this optimizer step (None unless ``bf16``), cast
        by one multi-tensor copy (``torch._foreach_copy_``), not a kernel per parameter."""
        if not self.master_weights:
            return None
        named = list(model.named_parameters())
        copies = [torch.empty_like(p, dtype=torch.bfloat16) for _, p in named]
        if copies:
            with torch.no_grad():
                torch._foreach_copy_(copies, [p.detach() for _, p in named])
        return {n: w.requires_grad_(p.requires_grad) for (n, p), w in zip(named, copies)}

    @contextlib.contextmanager
    def weights_in(self, model: nn.Module, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
        """Inside the block ``model`` computes with ``weights`` (the bf16 copies) in place of its
        parameters: its forward *and* backward, so full recomputation re-runs on the same copies.
        Nothing happens when ``weights`` is None."""
        if weights is None:
            yield
            return
        by_id = {id(p): weights[n] for n, p in model.named_parameters()}
        swapped = [(m, name, p) for m in model.modules() for name, p in m._parameters.items()
                   if p is not None and id(p) in by_id]
        for m, name, p in swapped:
            m._parameters[name] = by_id[id(p)]
        try:
            yield
        finally:
            for m, name, p in swapped:
                m._parameters[name] = p

    @torch.no_grad()
    def accumulate(self, model: nn.Module, weights: dict[str, torch.Tensor] | None) -> None:
        """Add the bf16 copies' gradients into the fp32 masters' ``.grad`` (after each micro-batch):
        the first micro-batch's by one multi-tensor cast, later ones cast into fp32 scratch (at
        most :data:`SCRATCH_BYTES` at a time) and added by one multi-tensor add; the same sums as
        adding each bf16 gradient into its fp32 one, bit for bit."""
        if weights is None:
            return
        pairs = [(p, weights[n]) for n, p in model.named_parameters() if weights[n].grad is not None]
        fresh = [(p, w.grad) for p, w in pairs if p.grad is None]
        adds = [(p.grad, w.grad) for p, w in pairs if p.grad is not None]
        if fresh:
            grads = [torch.empty_like(g, dtype=torch.float32) for _, g in fresh]
            torch._foreach_copy_(grads, [g for _, g in fresh])
            for (p, _), g in zip(fresh, grads):
                p.grad = g
        for chunk in _chunks(adds):
            scratch = [torch.empty_like(g, dtype=torch.float32) for _, g in chunk]
            torch._foreach_copy_(scratch, [g for _, g in chunk])
            torch._foreach_add_([master for master, _ in chunk], scratch)
        for _, w in pairs:
            w.grad = None


SCRATCH_BYTES = 64 * 2**20  # fp32 scratch of one multi-tensor cast-and-add in Precision.accumulate


def _chunks(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``pairs`` cut into runs of at most :data:`SCRATCH_BYTES` of fp32 (a larger tensor alone)."""
    out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[]]
    size = 0
    for pair in pairs:
        nbytes = pair[1].numel() * 4
        if out[-1] and size + nbytes > SCRATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(pair)
        size += nbytes
    return [c for c in out if c]


__all__ = ["Precision", "resolve_precision"]
