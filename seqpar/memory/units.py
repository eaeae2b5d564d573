"""Bytes as people read them: the one formatter every report, table and log line uses."""
from __future__ import annotations

UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def unit_for(n: float, least: float = 1.0) -> str:
    """The largest binary unit in which ``n`` bytes is at least ``least``: ``unit_for(3 * 2**20) == "MiB"``."""
    return next(u for u, k in UNITS.items() if abs(n) >= least * k or u == "B")


def human(n: float | None, unit: str | None = None, *, suffix: bool = True) -> str:
    """Bytes in binary units, ``human(3 * 2**20) == "3.00 MiB"``; ``unit`` fixes the unit (and
    ``suffix=False`` leaves it out, for a column that names it); ``None`` is ``"-"``."""
    if n is None:
        return "-"
    unit = unit or unit_for(n)
    return f"{n / UNITS[unit]:.2f}" + (f" {unit}" if suffix else "")


__all__ = ["UNITS", "human", "unit_for"]
