"""Dropout masks as a step draws them, and the three rules they must keep (DESIGN, "Rules"):

* a tensor every TP rank holds in full (a replicated region) gets the same mask on every TP rank;
* a tensor split over TP (a sequence shard under SP, different heads) gets a different mask per rank;
* a recomputation in backward replays exactly the mask its forward drew.

:class:`DropoutRecorder` observes a step from outside: a dispatch mode sees seqpar's stream draws
(``seqpar::stream_dropout`` / ``seqpar::core_dropout``) and ``aten.native_dropout``; ``nn.Dropout`` and
``F.dropout`` on the CPU decompose into ``bernoulli_`` on an empty tensor, scaled, then multiplied
into the input, so such a mask is paired with the input of the ``mul`` that consumes it. Module
hooks keep the name of the module each draw ran in. Each draw is kept as digests of its input and its mask, with the module it ran in and whether it ran in
forward or inside backward (a recomputation). The rules are then checked on digests alone, so
the check does not trust the model's own idea of which region a dropout is in.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

MIN_ELEMENTS = 16  # two independent masks of at least this many elements never coincide in practice


@dataclass(frozen=True)
class Draw:
    """One dropout draw: where, when, and digests of its input and mask."""

    where: str          # the innermost module that ran it ("blocks.0.attn.core")
    backward: bool      # drawn while backward ran (a recomputation)
    shape: tuple
    x: str              # digest of the input's bytes
    mask: str           # digest of the keep-mask


def digest(t: torch.Tensor) -> str:
    """A short digest of a tensor's values (contiguous CPU bytes)."""
    return hashlib.sha1(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def _draw_ops() -> set:
    ops = {torch.ops.aten.native_dropout.default}
    for name in ("stream_dropout", "core_dropout"):
        if hasattr(torch.ops.seqpar, name):
            ops.add(getattr(torch.ops.seqpar, name).default)
    return ops


class DropoutRecorder(TorchDispatchMode):
    """``with DropoutRecorder(model) as rec: <forward and backward>``; ``rec.draws`` after."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.names = {id(m): n or "(model)" for n, m in model.named_modules()}
        self.draws: list[Draw] = []
        self._stack: list[str] = []
        self._ops = _draw_ops()
        self._handles: list = []
        self._pending: dict[int, torch.Tensor] = {}

    def _where(self) -> str:
        return self._stack[-1] if self._stack else "(outside any module)"

    def _record(self, x: torch.Tensor, mask: torch.Tensor) -> None:
        backward = torch._C._current_graph_task_id() != -1
        self.draws.append(Draw(self._where(), backward, tuple(x.shape), digest(x), digest(mask)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.mul.Tensor, aten.mul_.Tensor) and self._pending and len(args) == 2:
            for x, noise in (args, args[::-1]):
                if isinstance(noise, torch.Tensor) and id(noise) in self._pending:
                    del self._pending[id(noise)]
                    self._record(x, noise != 0)  # before an in-place mul overwrites the input
                    break
        out = func(*args, **(kwargs or {}))
        if func in self._ops:
            self._record(args[0], out[1])
        elif func is aten.bernoulli_.float:
            self._pending[id(out)] = out  # the noise of a decomposed dropout, until its mul
        return out

    def _pre(self, module: nn.Module, args) -> None:
        self._stack.append(self.names.get(id(module), type(module).__name__))

    def _post(self, module: nn.Module, args, output) -> None:
        if self._stack:
            self._stack.pop()

    def __enter__(self):
        reg = nn.modules.module
        self._handles = [reg.register_module_forward_pre_hook(self._pre), reg.register_module_forward_hook(self._post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        return super().__exit__(*exc)


def tp_mask_problems(per_rank: list[list[Draw]]) -> list[str]:
    """The first two rules over one TP group's ranks (``per_rank[r]``: TP rank r's draws)."""
    forward = [[d for d in draws if not d.backward] for draws in per_rank]
    counts = [len(f) for f in forward]
    if len(set(counts)) > 1:
        return [f"TP ranks drew different numbers of dropout masks in forward: {counts}"]
    out = []
    for i, calls in enumerate(zip(*forward)):
        where = f"dropout #{i} in {calls[0].where} {list(calls[0].shape)}"
        masks = [c.mask for c in calls]
        if len({c.x for c in calls}) == 1:
            if len(set(masks)) > 1:
                out.append(f"{where}: same input on every TP rank (replicated region) but the masks differ")
        elif len(set(masks)) < len(masks) and calls[0].shape and _numel(calls[0].shape) >= MIN_ELEMENTS:
            same = [(a, b) for a in range(len(masks)) for b in range(a + 1, len(masks)) if masks[a] == masks[b]]
            out.append(f"{where}: a split tensor (SP/TP region) but TP ranks {same[0][0]} and {same[0][1]} "
                       f"drew the same mask")
    return out


def replay_problems(draws: list[Draw]) -> list[str]:
    """The third rule on one rank: each draw inside backward matches a forward draw on the same input."""
    forward: dict[tuple, set[str]] = {}
    for d in draws:
        if not d.backward:
            forward.setdefault((d.x, d.shape), set()).add(d.mask)
    out = []
    for d in draws:
        if d.backward:
            masks = forward.get((d.x, d.shape))
            if masks is None:
                out.append(f"recompute in {d.where} {list(d.shape)} dropped an input forward never dropped")
            elif d.mask not in masks:
                out.append(f"recompute in {d.where} {list(d.shape)} drew a different mask than its forward")
    return out


def _numel(shape: tuple) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


__all__ = ["DropoutRecorder", "Draw", "digest", "replay_problems", "tp_mask_problems"]
