"""Dense (layout-invariant) state of a pipeline rank's stages, keyed like the unsplit GPT.

Each rank gathers only its own stages' tensors over TP (:meth:`StageModule.to_dense`);
:func:`gather_dense` merges the per-stage dicts of every pipeline rank (for tests and small
models: it pickles through the pp group). A dense dict of the whole model loads into any
``(pp, m, tp)`` layout: each stage slices the keys it holds.
"""
from __future__ import annotations

import torch

from .. import sharding
from ..distributed.collectives import all_gather_object, group_size
from ..model.moe_sharding import slice_experts
from ..model.vocab import pad_rows


def stage_dense(parts, grads: bool = False) -> dict[str, torch.Tensor]:
    """This rank's stages' parameters (or their gradients, zeros where none) in the dense layout,
    under the GPT's names; the tied table appears once. A TP collective: every TP rank calls it."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        params = dict(part.named_parameters())
        local = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) if grads else p for n, p in params.items()}
        out.update(part.to_dense({n: t.detach() for n, t in local.items()}))
    return out


def gather_dense(local: dict[str, torch.Tensor], pp_group) -> dict[str, torch.Tensor]:
    """Merge every pipeline rank's :func:`stage_dense` dict (same on all ranks). Keys held by two
    stages (the tied table) must agree, which :meth:`PipelineParallel.step` guarantees."""
    if group_size(pp_group) == 1:
        return dict(local)
    gathered = all_gather_object({k: v.cpu() for k, v in local.items()}, pp_group)
    merged: dict[str, torch.Tensor] = {}
    for d in gathered:
        merged.update(d)
    return merged


def load_stage_dense(parts, state: dict[str, torch.Tensor]) -> None:
    """Copy the keys each stage holds from a dense dict of the whole model (extra keys ignored);
    a missing key or a wrong shape raises ``ValueError`` naming it."""
    for part in parts:
        t = part.tp_size
        local_state = slice_experts(part, pad_rows(state, part.config.padded_vocab(t)))  # this ep rank's experts
        expected = dict(part.named_parameters())
        missing = sorted(set(expected) - set(local_state))
        if missing:
            raise ValueError(f"stage {part.index}: dense state dict lacks {missing}")
        local = sharding.to_local(part, {k: local_state[k] for k in expected}, part.tp_group)
        sharding.copy_into(expected, local, f"stage {part.index}: dense state dict")
