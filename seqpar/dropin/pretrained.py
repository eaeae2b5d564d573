"""Hugging Face ``save_pretrained`` / ``from_pretrained`` for parallelized models.

A parallelized model holds only this rank's slices, so its own ``save_pretrained`` would write
shards under the full model's names (``parallelize`` replaces it by an error pointing here).
:func:`save_pretrained` gathers the full weights on every rank and writes them, config included,
from global rank 0: the folder loads with plain ``from_pretrained``, unparallelized. The way
back is :func:`load_pretrained`: ``from_pretrained`` on every rank, then ``parallelize``.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from ..distributed.collectives import all_reduce, group_rank, group_size, world_group
from ..distributed.mesh import ParallelMesh
from .spec import Plan
from .state_dict import dense_state_dict
from .tensor_parallel import parallelize
from .wrappers import parallelized


def save_pretrained(model: nn.Module, path: str | os.PathLike, **kwargs) -> None:
    """Write a parallelized ``transformers`` model to ``path`` as its unparallelized self (full
    weights in the original layout, config, generation config). A collective: call on every
    rank; global rank 0 writes, every rank returns once the folder is complete. ``kwargs`` go to
    ``PreTrainedModel.save_pretrained`` (``safe_serialization``, ``max_shard_size``, ...)."""
    inner, _ = parallelized(model, "save_pretrained")
    if "state_dict" in kwargs:
        raise ValueError("save_pretrained: the state dict is the gathered one; do not pass state_dict=")
    save = getattr(type(inner), "save_pretrained", None)
    if save is None:
        raise ValueError(f"save_pretrained: {type(inner).__name__} is not a transformers model; use "
                         f"seqpar.dropin.dense_state_dict(model) and torch.save")
    dense = dense_state_dict(inner)  # every rank takes part in the gathers
    world = world_group()
    if group_rank(world) == 0:
        save(inner, path, state_dict=dense, **kwargs)  # the class's method: the instance's one refuses
    if group_size(world) > 1:  # one element all-reduced: no rank returns before rank 0 has written
        device = next(inner.parameters()).device
        all_reduce(torch.zeros(1, device=device), world)


def load_pretrained(model_class, path: str | os.PathLike, plan: Plan, mesh: ParallelMesh | None, *,
                    sequence_parallel: bool = True, seed: int = 0, **kwargs) -> nn.Module:
    """``model_class.from_pretrained(path, **kwargs)`` on every rank, parallelized by ``plan``
    over ``mesh`` (dropout streams from ``seed``) and moved to ``mesh.device``. Each rank reads
    the full checkpoint once and keeps its slices."""
    model = model_class.from_pretrained(path, **kwargs)
    model = parallelize(model, plan, mesh, sequence_parallel=sequence_parallel, seed=seed)
    return model.to(mesh.device) if mesh is not None else model


__all__ = ["save_pretrained", "load_pretrained"]
