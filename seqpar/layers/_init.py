"""Layout-invariant parameter initialisation shared by the parallel layers.

By default every rank builds the full (master) tensor from the global RNG, which callers seed
identically on all ranks, and keeps its slice: the same seed gives the same full model for
any TP size. ``per_shard_init=True`` initialises only the local shard instead, from a stream
offset by the TP rank (no full-size allocation; values then depend on the layout).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from ..sharding import ParamLayout, local_shape, shard

InitMethod = Callable[[torch.Tensor], object]


def skip_init(tensor: torch.Tensor) -> None:
    """Sentinel ``init_method``: leave the tensor uninitialised (``from_dense`` fills it)."""


def default_linear_init(weight: torch.Tensor) -> None:
    """``nn.Linear``'s default: Kaiming-uniform with a=sqrt(5) over the full fan-in."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))


def build_param(full_shape: tuple[int, ...], layout: ParamLayout, tp_rank: int, tp_size: int,
                init: InitMethod, *, dtype: torch.dtype | None, device, per_shard_init: bool) -> nn.Parameter:
    """Create this rank's part of a parameter whose dense shape is ``full_shape``, laid out over
    ``tp_size`` ranks as ``layout`` declares (see :mod:`seqpar.sharding`)."""
    dtype = dtype or torch.get_default_dtype()
    shape = local_shape(full_shape, layout, tp_size)
    if init is skip_init:
        return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    if per_shard_init and layout.is_replicated(tp_size):
        raise ValueError(f"per_shard_init draws each rank's shard from its own stream, so the ranks sharing a "
                         f"replicated block (groups={layout.groups}, t={tp_size}) would disagree; use the master init")
    if per_shard_init and tp_size > 1 and layout.is_split:
        local = torch.empty(shape, dtype=dtype, device=device)
        seed = int(torch.randint(0, 2**62, (1,)).item()) + tp_rank  # same draw on all ranks, offset by rank
        devices = [local.device] if local.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            # only this shard's generator: torch.manual_seed would reseed every CUDA device
            gen = torch.cuda.default_generators[local.device.index or 0] if devices else torch.default_generator
            gen.manual_seed(seed)
            init(local)
        return nn.Parameter(local)
    master = torch.empty(full_shape, dtype=dtype)  # on CPU: identical numbers on any device
    init(master)
    local = shard(master, layout, tp_rank, tp_size).contiguous()
    return nn.Parameter(local.to(device) if device is not None else local)
