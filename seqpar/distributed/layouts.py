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
from fractions import Fraction
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
    ``groups``: per chunk, the number of whole blocks (attention heads) it holds, or None (rows
    split freely). A chunk of ``G`` groups is split over ``t`` ranks when ``t`` divides ``G``; when
    ``G`` divides ``t`` it is split over ``G`` pieces instead, piece ``j`` held by the ``t/G``
    consecutive ranks ``j*t/G ...`` (grouped-query key/value heads at ``t > g``: each rank holds
    the one head its query heads use). Those replicas' gradients are partial sums, summed over the
    ranks sharing the piece in backward (:func:`seqpar.distributed.grad_sync.replica_grad_sum`).
    """

    split_dim: int | None = None
    chunks: int | tuple[int, ...] = 1
    sp_replicated: bool = False
    groups: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        weights = self.chunk_weights
        if not weights or min(weights) < 1 or (len(weights) > 1 and self.split_dim is None):
            raise ValueError(f"ParamLayout: chunks={self.chunks} needs chunks >= 1 and a split_dim "
                             f"(split_dim={self.split_dim})")
        if self.sp_replicated and self.split_dim is not None:
            raise ValueError(f"ParamLayout: a split parameter (split_dim={self.split_dim}) cannot be SP-replicated")
        if self.groups is not None and (self.split_dim is None or len(self.groups) != len(weights)
                                        or any(g is not None and g < 1 for g in self.groups)):
            raise ValueError(f"ParamLayout: groups={self.groups} needs a split_dim and one positive count (or None) "
                             f"per chunk (chunks={self.chunks}, split_dim={self.split_dim})")

    @property
    def is_split(self) -> bool:
        return self.split_dim is not None

    @property
    def chunk_weights(self) -> tuple[int, ...]:
        """Relative sizes of the blocks: ``(1,) * chunks`` for an int."""
        return (1,) * self.chunks if isinstance(self.chunks, int) else tuple(self.chunks)

    def parts(self, t: int) -> tuple[int, ...]:
        """Per chunk, the number of distinct pieces over ``t`` ranks: ``t``, or ``G`` for a chunk of
        ``G`` groups with ``G < t`` (each piece then replicated over ``t/G`` ranks)."""
        out = []
        for g in self.groups or (None,) * len(self.chunk_weights):
            if g is not None and g % t and t % g:
                raise ValueError(f"ParamLayout: a chunk of {g} groups (heads) cannot be laid out over t={t} ranks: "
                                 f"t must divide {g} or be a multiple of it (groups={self.groups})")
            out.append(t if g is None or g % t == 0 else g)
        return tuple(out)

    def replicas(self, t: int) -> tuple[int, ...]:
        """Per chunk, how many consecutive ranks hold each piece (1: plainly split)."""
        return tuple(t // n for n in self.parts(t))

    def is_replicated(self, t: int) -> bool:
        """Whether some rank's piece is also held by another rank of the ``t`` (see ``groups``)."""
        return self.is_split and max(self.replicas(t)) > 1

    def chunk_sizes(self, dim_size: int, t: int = 1) -> list[int]:
        """This rank's sizes of the blocks along ``split_dim`` for a dense extent ``dim_size``
        (each block divided by its :meth:`parts`; by ``t`` without groups)."""
        w = self.chunk_weights
        if self.groups is None:
            unit, rem = divmod(dim_size, sum(w) * t)
            if rem:
                raise ValueError(f"dim {self.split_dim} of size {dim_size} is not divisible by t={t} x "
                                 f"chunks={self.chunks}")
            return [unit * k for k in w]
        unit, rem = divmod(dim_size, sum(w))
        dense = [unit * k for k in w]
        whole = [n if g is None else g for n, g in zip(self.parts(t), self.groups)]  # pieces divide these
        if rem or any(d % k for d, k in zip(dense, whole)):
            raise ValueError(f"dim {self.split_dim} of size {dim_size} cannot hold chunks={self.chunks} of "
                             f"groups={self.groups} over t={t} ranks")
        return [d // n for d, n in zip(dense, self.parts(t))]

    def dense_size(self, local_size: int, t: int) -> int:
        """The dense extent of ``split_dim`` whose rank pieces are ``local_size`` long."""
        if self.groups is None:
            return local_size * t
        w, n = self.chunk_weights, self.parts(t)
        per_unit = Fraction(0)
        for k, parts in zip(w, n):
            per_unit += Fraction(k, parts)  # local rows per dense row of one weight unit
        unit = Fraction(local_size) / per_unit
        if unit.denominator != 1:
            raise ValueError(f"a local extent {local_size} is no piece of chunks={self.chunks}, groups={self.groups} "
                             f"over t={t} ranks")
        return int(unit) * sum(w)

    def blocks(self, local_size: int, rank: int, t: int) -> list[tuple[int, int, int]]:
        """``(local start, size, dense start)`` along ``split_dim`` of each block rank ``rank`` holds."""
        sizes = self.chunk_sizes(self.dense_size(local_size, t), t)
        out, local, dense = [], 0, 0
        for n, parts, rep in zip(sizes, self.parts(t), self.replicas(t)):
            out.append((local, n, dense + (rank // rep) * n))
            local, dense = local + n, dense + n * parts
        return out

    def counted(self, rank: int, t: int) -> tuple[bool, ...]:
        """Per chunk, whether ``rank`` counts its piece in a norm over TP: every plainly split
        piece, and a replicated one only on the first of the ranks sharing it (clipping)."""
        return tuple(rank % rep == 0 for rep in self.replicas(t))


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
