"""After backward, for MoE models: expert gradients over their expert-data-parallel group, and the
step's expert load (logged, and moving the sigmoid router's balancing bias).

Expert weights are split over ``ep`` ranks carved from dp. An expert's local gradient already
holds every ep rank's tokens (they came through the all-to-all), so what is left is the
``edp = dp / ep`` ranks holding the same experts: their gradients are summed over edp and divided
by **dp** (not edp), since the loss is the mean over all dp ranks' micro-batches (summed over the
CP ranks' shares of a sequence, which ep may also span). DDP and FSDP
are told to leave the expert weights alone. Router and shared-expert weights are dense weights,
reduced over dp like any other.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, all_reduce, all_reduce_coalesced
from ..distributed.mesh import ParallelMesh
from ..sharding import local_tensor
from .fsdp import shard_rows
from ..model.moe import expert_parameters, moe_layers


class ExpertGrads:
    """The expert weights of ``model`` when ``mesh`` has ``ep > 1`` (``active``), reduced by :meth:`reduce`."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh):
        params = expert_parameters(model)
        self.model, self.mesh, self.active = model, mesh, mesh.ep_size > 1 and bool(params)
        self.names: list[str] = list(params) if self.active else []
        self.reduced_by_buckets = False  # the bf16 recipe's expert buckets reduce them instead
        self.reduced_by_fsdp = False     # FSDP2 over edp reduce-scatters them (a mean over edp)

    @property
    def params(self) -> list[nn.Parameter]:
        """The expert weights as the model holds them now (FSDP2 replaces the parameters it shards)."""
        if not self.active:
            return []
        return list(expert_parameters(self.model).values())

    def fsdp_mesh(self):
        """The 1-D DeviceMesh over this rank's edp group for FSDP2, or None when edp = 1 (the
        experts then stay plain and :meth:`reduce` divides them by dp)."""
        if not self.active or self.mesh.edp_group is None:
            return None
        from torch.distributed.device_mesh import DeviceMesh
        return DeviceMesh.from_group(self.mesh.edp_group, self.mesh.device.type, mesh_dim_names=("edp",))

    def reduce(self) -> None:
        """Sum the expert gradients over edp and divide by dp: one coalesced all-reduce (FSDP2 has
        averaged them over edp already: divided by ep more)."""
        if not self.active or self.reduced_by_buckets:
            return
        if self.reduced_by_fsdp:
            torch._foreach_mul_([local_tensor(p.grad) for p in self.params if p.grad is not None],
                                1.0 / self.mesh.ep_size)
            return
        for p in self.params:
            if p.grad is None:  # no token reached this layer's experts: a zero share, still reduced
                p.grad = torch.zeros_like(p)
        all_reduce_coalesced([p.grad for p in self.params], self.mesh.edp_group, divide_by=self.mesh.dp_size)


@torch.no_grad()
def finish_moe_step(model: nn.Module, dp_group: ProcessGroup | None) -> None:
    """Once per optimizer step, after backward: each MoE layer's tokens per expert of this step's
    micro-batches, summed over ``dp_group`` (one all-reduce of ``layers x E`` counts), kept as
    ``layer.step_load`` / ``layer.step_dropped``; the sigmoid router's bias moved by
    ``bias_update_rate * sign(mean load - load)`` (the same on every rank)."""
    layers = [m for _, m in moe_layers(model)]
    if not layers:
        return
    E = layers[0].moe.experts
    device = layers[0].router.weight.device
    zero = torch.zeros(E + 1, dtype=torch.float64, device=device)
    stats = torch.stack([zero if m.load is None else torch.cat([m.load, m.dropped.view(1)]) for m in layers])
    all_reduce(stats, dp_group)
    for m, row in zip(layers, stats):
        m.step_load, m.step_dropped, m.load, m.dropped = row[:E], row[E], None, None
        rate, bias = m.moe.bias_update_rate, m.router.expert_bias
        if rate > 0 and bias is not None:
            step = rate * torch.sign(row[:E].mean() - row[:E])
            local = local_tensor(bias)
            if local is not bias:  # FSDP2: this rank's dim-0 rows of the bias
                start, rows = shard_rows(E, bias.device_mesh.get_local_rank(), bias.device_mesh.size())
                step = step[start:start + rows]
            local += step.to(local.dtype)


def load_lines(model: nn.Module) -> list[str]:
    """One line per MoE layer: min / max tokens per expert of the last step (and dropped ones)."""
    out = []
    for name, m in moe_layers(model):
        load = getattr(m, "step_load", None)
        if load is None:
            continue
        dropped = f", dropped {int(m.step_dropped)}" if m.moe.capacity_factor is not None else ""
        out.append(f"           moe {name.removesuffix('.mlp')}: tokens per expert min {int(load.min())} "
                   f"max {int(load.max())} (mean {float(load.mean()):.1f}{dropped})")
    return out


__all__ = ["ExpertGrads", "finish_moe_step", "load_lines"]
