"""Key/value heads fewer than the TP ranks (grouped-query attention at ``t > g``) in a plan.

With ``g`` key/value heads and ``t`` a multiple of ``g``, each head is held whole by the ``t/g``
consecutive ranks whose query heads use it (their layers declare ``groups=(g,)``, see
:class:`~seqpar.sharding.ParamLayout`), and the attention modules' per-rank attributes say one
key/value head and ``a/t`` query heads per group. With ``t`` dividing ``g`` nothing differs from
a plain split.
"""
from __future__ import annotations

import torch.nn as nn

from .spec import Plan


def kv_count(model: nn.Module, plan: Plan) -> int | None:
    """``g`` from the model's config, or None when the plan declares no key/value heads."""
    if plan.kv is None:
        return None
    value = getattr(getattr(model, "config", None), plan.kv.config, None)
    return value if isinstance(value, int) else None


def check_kv(model: nn.Module, plan: Plan, t: int) -> list[str]:
    """Errors for a ``g`` that ``t`` neither divides nor is a multiple of."""
    g = kv_count(model, plan)
    if g is None or g % t == 0 or t % g == 0:
        return []
    return [f"config.{plan.kv.config} = {g} and t={t}: t must divide it or be a multiple of it "
            f"(each key/value head then replicated over t/{g} ranks)"]


def kv_groups(model: nn.Module, plan: Plan, t: int) -> tuple[int] | None:
    """The ``groups`` the key/value column layers declare: ``(g,)`` where heads are replicated."""
    g = kv_count(model, plan)
    return (g,) if g is not None and g < t else None


def set_kv_attrs(model: nn.Module, plan: Plan, t: int, matches) -> None:
    """Per-rank key/value head counts and query heads per key/value head on the attention modules
    (``matches(model, pattern)`` lists module names)."""
    g = kv_count(model, plan)
    if g is None:
        return
    parts = plan.kv.parts(g, t)
    for table, divisor in ((plan.kv.heads, parts), (plan.kv.groups, t // parts)):
        for pattern, attrs in table.items():
            for name in matches(model, pattern):
                m = model.get_submodule(name)
                for a in attrs:
                    if isinstance(getattr(m, a, None), int):
                        setattr(m, a, getattr(m, a) // divisor)


__all__ = ["kv_count", "check_kv", "kv_groups", "set_kv_attrs"]
