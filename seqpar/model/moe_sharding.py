"""Dense <-> local for the routed experts, which are split over expert parallelism (dim 0).

A rank of expert-parallel rank ``j`` holds experts ``j E_l ... (j+1) E_l - 1`` of every MoE layer:
rows ``[j E_l, (j+1) E_l)`` of the dense ``w1 [E, ., h]`` and ``w2 [E, h, f]``. The TP layouts
(:mod:`seqpar.sharding`) do not know the ep dimension; these three functions add it where the GPT
converts its state (dense state dicts, imports, exports, checkpoints' dense shapes).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed.collectives import all_gather_dim0, group_size
from .moe import moe_layers


def _experts(model: nn.Module) -> dict[str, nn.Module]:
    """Parameter name -> the GroupedExperts holding it."""
    return {f"{name}.experts.{p}": layer.experts for name, layer in moe_layers(model)
            for p, _ in layer.experts.named_parameters()}


def gather_experts(model: nn.Module, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dense`` with every expert tensor all-gathered over ep (rank order = expert order).
    A collective over each MoE layer's ep group: call on every rank."""
    out = dict(dense)
    for name in _experts(model):
        if name in out and group_size(model.mesh.ep_group) > 1:
            out[name] = all_gather_dim0(out[name].contiguous(), model.mesh.ep_group)[0]
    return out


def slice_experts(model: nn.Module, dense: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dense`` with every expert tensor cut to this rank's experts. No communication."""
    out = dict(dense)
    for name, experts in _experts(model).items():
        if name in out and experts.local != experts.experts:
            out[name] = out[name].narrow(0, experts.first, experts.local)
    return out


def expert_dense_shapes(model: nn.Module, shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """``shapes`` (dense over TP) with the expert tensors' dim 0 at all ``E`` experts."""
    out = dict(shapes)
    for name, experts in _experts(model).items():
        if name in out:
            out[name] = torch.Size((experts.experts, *out[name][1:]))
    return out


def expert_rows(model: nn.Module) -> dict[str, int]:
    """Parameter name -> the first dense dim-0 row (expert) this rank holds, for expert tensors."""
    return {name: experts.first for name, experts in _experts(model).items()}


__all__ = ["expert_dense_shapes", "expert_rows", "gather_experts", "slice_experts"]
