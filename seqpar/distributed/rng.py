"""Dropout randomness for tensor/sequence-parallel regions, and RNG capture for recompute.

Two named streams live in an :class:`RNGStreams` object owned by the model (no globals):

* ``"replicated"``: seeded identically on every TP rank. Dropout on a tensor that every TP
  rank holds in full (plain-TP residual path) must draw the same mask everywhere.
* ``"tp"``: seeded per TP rank. Dropout on a tensor split across TP ranks (attention
  probabilities of different heads, sequence shards under SP) must draw different masks.

``fork(name)`` swaps the stream's state into the device's default generator for the
duration of a block, so plain ``torch`` dropout ops draw from it. ``dropout(x, p, name)`` is the
same draw as one custom operator, ``seqpar::stream_dropout(x, p, state) -> (y, mask, state')``: a
pure function of the stream's state, so ``torch.compile`` traces it without a graph break and a
recomputation that replays it with the saved state draws the same mask, eager or compiled.

A CPU generator's state (5,056 bytes of Mersenne twister) means nothing to a CUDA generator
(Philox seed and offset) and the other way round, so :meth:`RNGStreams.get_state` records the
device type. Restoring states of another device type (a run checkpointed on GPUs, resumed on a
CPU) reseeds each stream from a hash of its saved state and returns one line saying so (the
checkpoint loader prints it in the run's log): deterministic (the same checkpoint resumes to the
same masks), replicated streams stay identical across TP ranks and per-rank streams stay
distinct, but the masks are not the ones the uninterrupted run would have drawn, which no
generator of the other device type could reproduce.
"""
from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

TP_SEED_OFFSET = 2718
T = TypeVar("T")
DEVICE_KEY = "device_type"  # entry of RNGStreams.get_state() naming the generators' device type


def _get_device_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_device_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _copy(state: torch.Tensor) -> torch.Tensor:
    """A copy of a generator state. States are host bookkeeping, never model data: they stay real
    tensors even under a fake-tensor mode (``seqpar train --dry-run``), where a clone would be a
    fake tensor that ``set_rng_state`` cannot read."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is None:
        return state.clone()
    with _disable_current_modes():
        return state.clone()


def _state_device_type(states: dict) -> str:
    """The device type recorded with ``states``; for states saved before it was recorded, the CPU
    when the first state has the CPU generator's size, else CUDA."""
    if DEVICE_KEY in states:
        return str(states[DEVICE_KEY])
    first = next(v for k, v in states.items() if k != DEVICE_KEY)
    return "cpu" if first.numel() == torch.get_rng_state().numel() else "cuda"


def _seed_from_state(state: torch.Tensor) -> int:
    """A 63-bit seed determined by the bytes of a generator state."""
    digest = hashlib.sha256(state.detach().cpu().contiguous().numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen.get_state()


def _swap_in(device: torch.device, state: torch.Tensor) -> torch.Tensor:
    saved = _get_device_state(device)
    _set_device_state(device, state)
    return saved


def run_with_state(device: torch.device, state: torch.Tensor, fn: Callable[[], T]) -> tuple[T, torch.Tensor]:
    """``(fn(), state after)``: ``fn`` run with ``state`` as ``device``'s default generator state
    (its random ops draw from it); the default generator is left as it was. Not traceable: the
    custom ops below (and :func:`seqpar.recompute.stream_sdpa`) call it inside their kernels."""
    saved = _swap_in(device, state)
    try:
        out = fn()
        after = _get_device_state(device)
    finally:
        _set_device_state(device, saved)
    return out, after


def _draw(x: torch.Tensor, p: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.native_dropout(x, p, True)`` drawn from generator state ``state``: returns the output,
    the 1-byte keep mask and the generator's state after the draw. The device's default generator
    is left as it was."""
    (y, mask), after = run_with_state(x.device, state, lambda: torch.native_dropout(x, p, True))
    return y, mask, after


def _fake(x, p, state):
    return torch.empty_like(x), torch.empty_like(x, dtype=torch.bool), torch.empty_like(state)


def _setup(ctx, inputs, output):
    ctx.scale = 1.0 / (1.0 - inputs[1])
    ctx.save_for_backward(output[1])  # the mask only, as native_dropout keeps


def _backward(ctx, grad_y, grad_mask, grad_state):
    (mask,) = ctx.saved_tensors
    return torch.ops.aten.native_dropout_backward(grad_y, mask, ctx.scale), None, None


def _register(name: str):
    op = torch.library.custom_op(f"seqpar::{name}", mutates_args=())(_draw)
    op.register_fake(_fake)
    op.register_autograd(_backward, setup_context=_setup)
    return op


# the same draw under two names, so a selective-recompute policy can tell the attention core's
# dropout (recomputed) from the residual and embedding dropouts (kept)
stream_dropout = _register("stream_dropout")
core_dropout = _register("core_dropout")


# ``model.recompute_ops: [dropout]``: the same draw, keeping the generator state before it (bookkeeping,
# 5,056 bytes on the CPU, 16 on CUDA) instead of the 1-byte mask; backward redraws the mask from it
@torch.library.custom_op("seqpar::redrawn_dropout", mutates_args=())
def redrawn_dropout(x: torch.Tensor, p: float, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y, _, after = _draw(x, p, state)
    return y, after


@torch.library.custom_op("seqpar::redrawn_dropout_backward", mutates_args=())
def redrawn_dropout_backward(grad: torch.Tensor, p: float, state: torch.Tensor) -> torch.Tensor:
    """The forward's mask drawn again from ``state`` (the draw reads only the shape, dtype and
    generator), applied to ``grad``."""
    _, mask, _ = _draw(torch.zeros_like(grad), p, state)
    return torch.ops.aten.native_dropout_backward(grad, mask, 1.0 / (1.0 - p))


@redrawn_dropout.register_fake
def _(x, p, state):
    return torch.empty_like(x), torch.empty_like(state)


@redrawn_dropout_backward.register_fake
def _(grad, p, state):
    return torch.empty_like(grad)


def _redrawn_setup(ctx, inputs, output):
    ctx.p = inputs[1]
    ctx.save_for_backward(inputs[2])  # the state before the draw, not the mask


def _redrawn_backward(ctx, grad_y, grad_state):
    (state,) = ctx.saved_tensors
    return torch.ops.seqpar.redrawn_dropout_backward(grad_y, ctx.p, state), None, None


redrawn_dropout.register_autograd(_redrawn_backward, setup_context=_redrawn_setup)


class RNGStreams:
    """Named generator states for dropout; see the module docstring.

    The streams live on ``device`` (a CUDA generator's state differs from the CPU's); a model
    moves its streams with its parameters (:meth:`to`), re-seeding them for the new device.
    """

    def __init__(self, seed: int, tp_rank: int = 0, device: str | torch.device = "cpu"):
        self.seed, self.tp_rank = seed, tp_rank
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] | None = None  # seeded on first use, on self.device
        self._drawn = False

    @property
    def states(self) -> dict[str, torch.Tensor]:
        if self._states is None:
            self._states = {"replicated": _seeded_state(self.device, self.seed),
                            "tp": _seeded_state(self.device, self.seed + TP_SEED_OFFSET + self.tp_rank)}
        return self._states

    def to(self, device: str | torch.device) -> "RNGStreams":
        """Move the streams to ``device`` (a no-op on the same device). They restart from the seed
        there, so this must happen before any draw: moving streams that have already drawn raises."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device == self.device:
            return self
        if self._drawn:
            raise RuntimeError(f"the dropout RNG streams have already drawn on {self.device}; move the model to "
                               f"{device} before training (or restore a checkpoint's RNG state after moving)")
        self.device, self._states = device, None
        return self

    @contextmanager
    def fork(self, name: str = "tp") -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is untouched after."""
        if name not in self.states:
            raise ValueError(f"unknown RNG stream {name!r}; known: {sorted(self.states)}")
        self._drawn = True
        saved = _get_device_state(self.device)
        _set_device_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_device_state(self.device)
            _set_device_state(self.device, saved)

    def dropout(self, x: torch.Tensor, p: float, name: str = "tp", *, core: bool = False,
                redraw: bool = False) -> torch.Tensor:
        """``x`` with dropout ``p`` (training mode) drawn from stream ``name``; keeps a 1-byte mask.
        Traceable by ``torch.compile`` (see the module docstring); call :meth:`materialize` before
        compiling, since seeding the streams creates generators. ``core``: the attention core's
        dropout (``seqpar::core_dropout``, the op selective recompute replays). ``redraw``: keep
        the generator state instead of the mask and redraw the same mask in backward
        (``seqpar::redrawn_dropout``)."""
        if name not in self.states:
            raise ValueError(f"unknown RNG stream {name!r}; known: {sorted(self.states)}")
        self._drawn = True
        if redraw:
            y, self.states[name] = torch.ops.seqpar.redrawn_dropout(x, p, self.states[name])
            return y
        op = torch.ops.seqpar.core_dropout if core else torch.ops.seqpar.stream_dropout
        y, _, self.states[name] = op(x, p, self.states[name])
        return y

    def advance(self, name: str, state: torch.Tensor) -> None:
        """Set stream ``name`` to ``state``, the generator state after a draw made from its state by
        an op of its own (a fused attention kernel's dropout); traceable, like :meth:`dropout`."""
        if name not in self.states:
            raise ValueError(f"unknown RNG stream {name!r}; known: {sorted(self.states)}")
        self._drawn = True
        self.states[name] = state

    def materialize(self) -> "RNGStreams":
        """Seed the streams now (they are otherwise seeded at their first draw)."""
        _ = self.states
        return self

    def get_state(self) -> dict:
        """Each stream's generator state, and under ``"device_type"`` the device type they belong to."""
        return {**{k: _copy(v) for k, v in self.states.items()}, DEVICE_KEY: self.device.type}

    def set_state(self, states: dict) -> str | None:
        """Put back :meth:`get_state`'s states. States of another device type reseed the streams
        deterministically from them (see the module docstring); the returned line says so (for the
        run's log), else ``None``."""
        missing = set(self.states) - set(states)
        if missing:
            raise ValueError(f"RNG state is missing streams {sorted(missing)}")
        saved = _state_device_type(states)
        names = [k for k in states if k != DEVICE_KEY]
        if saved == self.device.type:
            self._states = {k: _copy(states[k]) for k in names}
            return None
        self._states = {k: _seeded_state(self.device, _seed_from_state(states[k])) for k in names}
        return (f"dropout RNG streams saved on {saved} are restored on {self.device.type}: a {saved} generator "
                f"state does not fit a {self.device.type} generator, so each stream is reseeded from its saved "
                f"state (deterministic, but not the masks the run would have drawn on {saved})")


def capture_rng(streams: RNGStreams | None = None) -> dict:
    """Snapshot the CPU, CUDA (when initialised) and stream states, for replay in recompute."""
    snap: dict = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        snap["cuda"] = torch.cuda.get_rng_state()
    if streams is not None:
        snap["streams"] = streams.get_state()
    return snap


def restore_rng(snap: dict, streams: RNGStreams | None = None) -> str | None:
    """Put back a snapshot taken by :func:`capture_rng`; returns :meth:`RNGStreams.set_state`'s line
    when the streams were saved on another device type."""
    torch.set_rng_state(snap["cpu"])
    if "cuda" in snap:
        torch.cuda.set_rng_state(snap["cuda"])
    if streams is not None and "streams" in snap:
        return streams.set_state(snap["streams"])
    return None


@contextmanager
def replay_rng(snap: dict, streams: RNGStreams | None = None) -> Iterator[None]:
    """Run a block with the RNG states of ``snap``, then return every state to what it was."""
    current = capture_rng(streams)
    restore_rng(snap, streams)
    try:
        yield
    finally:
        restore_rng(current, streams)


def capture_streams(streams: list) -> dict:
    """A rank's RNG snapshot: torch's generators and its first stream (:func:`capture_rng`), plus
    the states of further streams (one per pipeline stage on the rank)."""
    snap = capture_rng(streams[0] if streams else None)
    snap["more_streams"] = [s.get_state() for s in streams[1:]]
    return snap


def restore_streams(snap: dict, streams: list) -> str | None:
    """Put back :func:`capture_streams`'s snapshot; the line saying the streams were reseeded (saved
    on another device type), else ``None``."""
    notes = [restore_rng(snap, streams[0] if streams else None)]
    notes += [s.set_state(state) for s, state in zip(streams[1:], snap.get("more_streams", []))]
    return next((n for n in notes if n), None)
