"""How each parameter is laid out over tensor parallelism: declared by the layers, read by everyone.

A seqpar layer declares the layout of every parameter it owns in a :class:`ParamLayout` (its
``param_layouts()`` method); modules that are not seqpar layers (norms, position tables) are
replicated unless :func:`mark_sp_replicated` declares them SP-replicated. The conversions between
dense and local tensors that read these declarations are in :mod:`seqpar.sharding`; this module is
only the declarations, so the gradient reductions of :mod:`seqpar.distributed.grad_sync` can read
them without depending on anything above the communication layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn

ATTR = "_seqpar_param_layouts"  # per-module declarations for modules that are not seqpar layers


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out over the TP group.

    ``split_dim``: the dim split into ``t`` pieces (None: every rank holds the whole tensor).
    ``chunks``: blocks along ``split_dim`` split separately (see the module docstring): an int
    for equal blocks, or a tuple of relative block sizes for unequal ones (grouped-query
    attention's ``[q; k; v]`` with ``a`` query and ``g`` key/value heads: ``(a, g, g)``).
    ``sp_replicated``: replicated, but each rank's gradient covers only its sequence shard, so
    gradients are summed over TP after backward (LayerNorms, row-parallel biases under SP).
    """

    split_dim: int | None = None
    chunks: int | tuple[int, ...] = 1
    sp_replicated: bool = False

    def __post_init__(self) -> None:
        weights = self.chunk_weights
        if not weights or min(weights) < 1 or (len(weights) > 1 and self.split_dim is None):
            raise ValueError(f"ParamLayout: chunks={self.chunks} needs chunks >= 1 and a split_dim "
                             f"(split_dim={self.split_dim})")
        if self.sp_replicated and self.split_dim is not None:
            raise ValueError(f"ParamLayout: a split parameter (split_dim={self.split_dim}) cannot be SP-replicated")

    @property
    def is_split(self) -> bool:
        return self.split_dim is not None

    @property
    def chunk_weights(self) -> tuple[int, ...]:
        """Relative sizes of the blocks: ``(1,) * chunks`` for an int."""
        return (1,) * self.chunks if isinstance(self.chunks, int) else tuple(self.chunks)

    def chunk_sizes(self, dim_size: int, t: int = 1) -> list[int]:
        """Sizes of the blocks along ``split_dim`` for a dense extent ``dim_size``, each divided by ``t``."""
        w = self.chunk_weights
        unit, rem = divmod(dim_size, sum(w) * t)
        if rem:
            raise ValueError(f"dim {self.split_dim} of size {dim_size} is not divisible by t={t} x "
                             f"chunks={self.chunks}")
        return [unit * k for k in w]


REPLICATED = ParamLayout()
SP_REPLICATED = ParamLayout(sp_replicated=True)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of ``t``: ``t.to_local()`` for a DTensor (FSDP2's sharded parameters,
    gradients and AdamW moments; a view of its storage), else ``t`` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


# ---------------------------------------------------------------------------------- declarations
def mark_sp_replicated(module: nn.Module, names: Iterable[str] | None = None) -> nn.Module:
    """Declare ``module``'s own parameters ``names`` (default: all) SP-replicated. For modules that
    are not seqpar layers (norms you add to a sequence-parallel region); returns ``module``."""
    own = dict(module.named_parameters(recurse=False))
    names = tuple(own) if names is None else tuple(names)
    unknown = [n for n in names if n not in own]
    if unknown:
        raise ValueError(f"{type(module).__name__} has no parameters {unknown}; it has {sorted(own)}")
    declared = dict(module.__dict__.get(ATTR, {}))
    declared.update({n: SP_REPLICATED for n in names})
    module.__dict__[ATTR] = declared  # a plain attribute, not a submodule or a tensor patch
    return module


def module_layouts(module: nn.Module) -> dict[str, ParamLayout]:
    """Layouts of ``module``'s own (non-recursive) parameters: a seqpar layer's ``param_layouts()``,
    else what :func:`mark_sp_replicated` declared, else replicated."""
    own = [n for n, _ in module.named_parameters(recurse=False)]
    declared = module.param_layouts() if hasattr(module, "param_layouts") else module.__dict__.get(ATTR, {})
    return {n: declared.get(n, REPLICATED) for n in own}


def param_layouts(model: nn.Module) -> dict[str, ParamLayout]:
    """Parameter name (as in ``model.named_parameters()``, shared parameters once) -> layout."""
    out: dict[str, ParamLayout] = {}
    seen: set[int] = set()
    for mname, module in model.named_modules():
        layouts = module_layouts(module)
        for pname, p in module.named_parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                out[f"{mname}.{pname}" if mname else pname] = layouts[pname]
    return out


def sp_replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every SP-replicated parameter of ``model`` in module order, each once."""
    params = dict(model.named_parameters())
    return [params[n] for n, lay in param_layouts(model).items() if lay.sp_replicated]


def split_parameters(model: nn.Module) -> set[int]:
    """``id()`` of the parameters split over TP (each rank holds a different part)."""
    params = dict(model.named_parameters())
    return {id(params[n]) for n, lay in param_layouts(model).items() if lay.is_split}
