"""The layouts ``seqpar verify`` runs, named by short tokens: ``t2``, ``t2-nosp``, ``cp2-ring``,
``dp2-fsdp``, ``t2-selective``, ``pp2``, ``t2-compile`` ...

A name is tokens joined by ``-``: ``tN`` (tensor parallel size), ``nosp`` (plain TP, no sequence
parallelism), ``cpN`` with ``ring`` or ``allgather`` (context parallel and its K/V exchange),
``ppN`` (pipeline stages), ``dpN`` with ``ddp`` or ``fsdp``, ``none`` / ``selective`` / ``full``
(recompute; default none) and ``compile``. Every layout runs on ``tp x cp x pp x dp`` local ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import UserError
from ...model.modes import DATA_PARALLEL_MODES, RECOMPUTE_MODES, RecomputeMode

Recompute = RecomputeMode

# the default set: each technique once, on 2 ranks, plus t=4 (4 ranks)
DEFAULT_LAYOUTS = ("t2", "t2-nosp", "t2-selective", "t2-full", "t4", "cp2", "cp2-ring", "pp2", "dp2-ddp",
                   "dp2-fsdp")


@dataclass(frozen=True)
class Layout:
    """One parallel layout: sizes of each dimension and the modes that change the step."""

    name: str
    tp: int = 1
    sp: bool = True                 # sequence parallelism (only meaningful at tp > 1)
    cp: int = 1
    cp_comm: str = "allgather"
    pp: int = 1
    dp: int = 1
    dp_mode: str = "ddp"            # "ddp" | "fsdp" (dp > 1)
    recompute: Recompute = "none"
    compile: bool = False

    @property
    def world(self) -> int:
        """Ranks this layout runs on."""
        return self.tp * self.cp * self.pp * self.dp


def _size(token: str, prefix: str) -> int | None:
    rest = token[len(prefix):]
    return int(rest) if token.startswith(prefix) and rest.isdigit() and int(rest) >= 1 else None


def parse_layout(name: str) -> Layout:
    """``"t2-nosp"`` -> ``Layout(name="t2-nosp", tp=2, sp=False)``; :class:`UserError` naming the
    token that is not one of the grammar's (module docstring)."""
    fields: dict = {}
    for token in name.strip().lower().split("-"):
        for key, prefix in (("tp", "t"), ("cp", "cp"), ("pp", "pp"), ("dp", "dp")):
            value = _size(token, prefix)
            if value is not None:
                fields[key] = value
                break
        else:
            if token == "nosp":
                fields["sp"] = False
            elif token in ("ring", "allgather"):
                fields["cp_comm"] = token
            elif token in DATA_PARALLEL_MODES:
                fields["dp_mode"] = token
            elif token in RECOMPUTE_MODES:
                fields["recompute"] = token
            elif token == "compile":
                fields["compile"] = True
            else:
                raise UserError(f"--layouts: {token!r} in layout {name!r} is not a layout token; use tN, nosp, cpN, "
                                f"ring, allgather, ppN, dpN, ddp, fsdp, none, selective, full, compile "
                                f"(e.g. t2, t2-nosp, cp2-ring, dp2-fsdp, t2-selective)")
    if fields.get("dp", 1) > 1 and "dp_mode" not in fields:
        fields["dp_mode"] = "fsdp"
    return Layout(name=name.strip().lower(), **fields)


def parse_layouts(text: str | None) -> list[Layout]:
    """A comma-separated list of layout names (None or ``"default"``: :data:`DEFAULT_LAYOUTS`)."""
    names = DEFAULT_LAYOUTS if text in (None, "", "default") else [n for n in text.split(",") if n.strip()]
    layouts = [parse_layout(n) for n in names]
    seen: set[str] = set()
    for lay in layouts:
        if lay.name in seen:
            raise UserError(f"--layouts names {lay.name!r} twice")
        seen.add(lay.name)
    return layouts


__all__ = ["DEFAULT_LAYOUTS", "Layout", "parse_layout", "parse_layouts"]
