"""Find the parallelized model inside ``torch.compile`` / ``DistributedDataParallel`` wrappers.

A compiled module keeps the real one as ``_orig_mod`` and prefixes every state-dict key with
``_orig_mod.``; DDP and ``DataParallel`` keep it as ``.module`` (prefix ``module.``). Every
drop-in function that reads or writes weights goes through :func:`unwrap`, so keys are the
model's own whatever wraps it. FSDP shards the parameters themselves over data parallelism:
those are refused with an error instead of producing a partial state dict.
"""
from __future__ import annotations

import torch.nn as nn

from .spec import Parallelized


def _is_fsdp(model: nn.Module) -> bool:
    names = {c.__name__ for c in type(model).__mro__}
    return bool(names & {"FullyShardedDataParallel", "FSDPModule"})


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside any ``torch.compile`` (``_orig_mod``), ``DistributedDataParallel`` or
    ``DataParallel`` (``module``) wrappers of ``model``; ``model`` itself when unwrapped."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while True:
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module) and type(model).__name__ == "OptimizedModule":
            model = inner
        elif isinstance(model, (DistributedDataParallel, DataParallel)):
            model = model.module
        else:
            return model


def parallelized(model: nn.Module, what: str) -> tuple[nn.Module, Parallelized]:
    """``(unwrapped model, its Parallelized record)``; ``ValueError`` naming ``what`` when the model
    was not parallelized by ``seqpar.parallelize`` or its parameters are FSDP-sharded."""
    inner = unwrap(model)
    if _is_fsdp(inner) or any(_is_fsdp(m) for m in inner.modules()):
        raise ValueError(f"{what}: the model is wrapped in FSDP, which shards its parameters over data "
                         f"parallelism; call {what} before applying FSDP (or on a model without it)")
    state = inner.__dict__.get("seqpar")
    if not isinstance(state, Parallelized):
        raise ValueError(f"{what}: {type(inner).__name__} was not parallelized by seqpar.parallelize")
    return inner, state


__all__ = ["unwrap", "parallelized"]
