"""Dropout of a parallelized model, drawn from seqpar RNG streams (DESIGN, "Rules": per-TP-rank
masks in sequence-parallel regions, identical masks in replicated ones, replayed by recompute).

``parallelize(..., seed=0)`` gives the model one :class:`~seqpar.distributed.rng.RNGStreams`
(``model.seqpar.streams``): ``"replicated"`` seeded with ``seed`` on every rank, ``"tp"`` seeded
per TP rank. What draws from which:

* an ``nn.Dropout`` the plan names ``"sequence"`` (GPT-2's residual dropouts after ``c_proj``)
  becomes seqpar's stream :class:`~seqpar.model.gpt.Dropout`: under SP it drops a sequence shard
  ``[b, s/t, h]`` and draws from ``"tp"``; without SP every rank holds the full tensor and it
  draws from ``"replicated"`` (:func:`set_dropout_streams` follows ``set_sequence_parallel``);
* the attention core of the modules ``Plan.heads`` names runs on this rank's heads: its dropout
  draws from ``"tp"`` (:func:`seqpar.dropin.attention.use_streams`), and
  ``checkpoint_attention`` replays those draws in backward;
* any other dropout (GPT-2's embedding dropout ``drop``, before the region) keeps torch's default
  generator: every rank holds the same tensor, seed torch alike on every rank.

``torch.utils.checkpoint`` (and Hugging Face's gradient checkpointing, built on it) replays only
torch's own generators; :func:`replay_streams` is the ``context_fn`` that replays the streams too.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn as nn

from ..distributed.mesh import ParallelMesh
from ..distributed.rng import RNGStreams
from ..errors import UserError
from ..model.context import stream_rank
from ..model.gpt import Dropout
from .attention import use_streams
from .spec import Parallelized, Style
from .wrappers import parallelized


def check_dropout(name: str, m: nn.Module, style: Style) -> list[str]:
    """A ``"sequence"`` entry naming a dropout must name an ``nn.Dropout`` (elementwise masks)."""
    if style.kind == "sequence" and isinstance(m, nn.modules.dropout._DropoutNd) and type(m) is not nn.Dropout:
        return [f"{name} (sequence) is a {type(m).__name__}; only nn.Dropout draws from seqpar's streams"]
    return []


def _device(model: nn.Module, mesh: ParallelMesh | None) -> torch.device:
    if mesh is not None:
        return mesh.device
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def install_streams(model: nn.Module, state: Parallelized, mesh: ParallelMesh | None, seed: int,
                    heads: list[str]) -> RNGStreams:
    """Give ``model`` its streams (on ``mesh.device``, or its parameters' device without a mesh):
    swap the plan's ``"sequence"`` ``nn.Dropout`` s for stream dropouts and hand the streams to
    the attention modules ``heads``. Returns the streams (kept as ``state.streams``)."""
    streams = RNGStreams(seed, tp_rank=0 if mesh is None else stream_rank(mesh), device=_device(model, mesh))
    streams.materialize()  # seeded now: nothing is created while torch.compile traces a draw
    for name, style in state.resolved.items():
        m = model.get_submodule(name)
        if style.kind == "sequence" and type(m) is nn.Dropout:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, Dropout(m.p, streams, "replicated"))
    heads_modules = [model.get_submodule(n) for n in heads]
    use_streams(model, heads_modules, streams)
    if _draws_dropout(model, heads_modules):
        model.register_forward_pre_hook(_ReplayCheck(model, streams))
    return streams


def _draws_dropout(model: nn.Module, heads: list[nn.Module]) -> bool:
    """Some dropout of ``model`` has p > 0 (a dropout module, or an attention module's own rate)."""
    return any(isinstance(m, (nn.modules.dropout._DropoutNd, Dropout)) and m.p > 0 for m in model.modules()) or \
        any(float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0 for m in heads)


class _ReplayCheck:
    """A forward pre-hook of a parallelized model whose dropout draws from its streams: refuses a
    training forward under gradient checkpointing (Hugging Face's, which sets
    ``gradient_checkpointing`` and ``_gradient_checkpointing_func`` on its layers) whose
    ``context_fn`` is not :func:`replay_streams` of this model. Without it each recomputed layer
    would draw new masks from the streams: gradients silently wrong."""

    def __init__(self, model: nn.Module, streams: RNGStreams):
        self.streams = streams
        self.layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]  # found once

    def __call__(self, module: nn.Module, args) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        for layer in self.layers:
            if getattr(layer, "gradient_checkpointing", False) is not True:
                continue
            fn = getattr(layer, "_gradient_checkpointing_func", None)
            context_fn = (getattr(fn, "keywords", None) or {}).get("context_fn")
            if getattr(context_fn, "seqpar_streams", None) is not self.streams:
                raise UserError(
                    f"{type(module).__name__}: gradient checkpointing is on, and this model's dropout draws from "
                    f"seqpar's RNG streams, which torch.utils.checkpoint does not replay: the recomputed masks "
                    f"would differ from the forward's and the gradients would be wrong. Enable it with "
                    f"model.activation_checkpointing_enable({{'use_reentrant': False, "
                    f"'context_fn': seqpar.dropin.replay_streams(model)}}), or set the dropouts to 0")


def set_dropout_streams(model: nn.Module, state: Parallelized) -> None:
    """Point each stream dropout of the plan at ``"tp"`` under SP, ``"replicated"`` without."""
    for name, style in state.resolved.items():
        m = model.get_submodule(name)
        if style.kind == "sequence" and isinstance(m, Dropout):
            m.stream = "tp" if state.sequence_parallel else "replicated"


def replay_streams(model: nn.Module) -> Callable[[], tuple]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` over
    part of a parallelized ``model``: each call snapshots ``model.seqpar.streams`` in forward and
    puts the snapshot back while backward recomputes, so the recomputed dropout masks are the
    forward's (torch's own generators are replayed by the checkpoint itself). Hugging Face:
    ``model.gradient_checkpointing_enable({"use_reentrant": False, "context_fn": replay_streams(model)})``."""
    streams = parallelized(model, "replay_streams")[1].streams

    def context_fn() -> tuple:
        snap: dict = {}

        @contextmanager
        def forward() -> Iterator[None]:
            snap.update(streams.get_state())
            yield

        @contextmanager
        def recompute() -> Iterator[None]:
            current = streams.get_state()
            streams.set_state(snap)
            try:
                yield
            finally:
                streams.set_state(current)
        return forward(), recompute()
    context_fn.seqpar_streams = streams  # what a parallelized model's checkpointing check looks for
    return context_fn


__all__ = ["check_dropout", "install_streams", "replay_streams", "set_dropout_streams"]
