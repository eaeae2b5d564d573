"""Full (dense) weights of a parallelized model in its original layout, and back.

:func:`dense_state_dict` gathers every split parameter over TP (the layers declare how they are
split, :mod:`seqpar.sharding`), transposes GPT-2's ``Conv1D`` weights back to ``[in, out]`` and
returns the unparallelized model's state dict. :func:`load_dense_state_dict` is the inverse: each
rank keeps its slice. Both see through ``torch.compile`` and DDP wrappers, so the keys are the
model's own whatever wraps it.
"""
from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from .. import sharding
from ..distributed.collectives import group_rank, group_size
from .wrappers import parallelized


def _conv_keys(state) -> set[str]:
    return {f"{name}.weight" if name else "weight" for name, (_, conv) in state.swapped.items() if conv}


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parallelized model's full state dict in the original module layout (Conv1D transposed
    back, fused blocks in their original order), loadable into the unparallelized model.
    A collective: call on every TP rank."""
    inner, state = parallelized(model, "dense_state_dict")
    params = dict(inner.named_parameters())
    dense = sharding.to_dense(inner, params, state.tp_group)  # every layout as its layer declares it
    by_id = {id(p): dense[n] for n, p in params.items()}
    out = {k: by_id[id(v)] if id(v) in by_id else v.detach().clone()
           for k, v in inner.state_dict(keep_vars=True).items()}
    for key in _conv_keys(state):  # GPT-2's Conv1D stores [in, out]
        out[key] = out[key].t().contiguous()
    return out


def load_dense_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Load a full state dict of the unparallelized model (as :func:`dense_state_dict` returns,
    or the original model's ``state_dict()``) into the parallelized ``model``: each rank copies
    its slice in. No communication. ``strict``: missing or unexpected keys raise, as in
    ``nn.Module.load_state_dict``."""
    inner, state = parallelized(model, "load_dense_state_dict")
    convs = _conv_keys(state)
    params = dict(inner.named_parameters())
    name_of = {id(p): n for n, p in params.items()}
    alias = {k: name_of[id(v)] for k, v in inner.state_dict(keep_vars=True).items() if id(v) in name_of}
    layouts, shapes = sharding.param_layouts(inner), sharding.dense_shapes(inner, state.tp_group)
    rank, t = group_rank(state.tp_group), group_size(state.tp_group)
    out, wrong = {}, []
    for key, given in state_dict.items():
        value = given.t() if key in convs else given  # GPT-2's Conv1D [in, out] -> [out, in]
        name = alias.get(key)  # tied keys (lm_head.weight) resolve to the one parameter they share
        if name is None:
            out[key] = value
        elif value.shape != shapes[name]:
            expected = tuple(shapes[name])[::-1] if key in convs else tuple(shapes[name])
            wrong.append(f"{key}: {tuple(given.shape)} (expected {expected})")
        else:
            out[key] = sharding.shard(value, layouts[name], rank, t)
    if wrong:
        raise ValueError(f"load_dense_state_dict: full tensors of the wrong shape: {'; '.join(wrong[:4])}")
    inner.load_state_dict(out, strict=strict)


__all__ = ["dense_state_dict", "load_dense_state_dict"]
