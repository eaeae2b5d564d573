"""The configs shipped inside the package (``seqpar/configs``), found by file path or by name.

They are package data, so ``seqpar train tiny-cpu`` and ``seqpar memory --paper`` work from an
installed wheel as well as from a source checkout (where ``configs/`` points at the same files).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path, PurePosixPath

from ..errors import MissingFile

SUFFIXES = (".yaml", ".yml")


def shipped_dir() -> Path:
    """The directory holding the shipped YAML configs (``paper/`` holds the paper's Table 3 models)."""
    return Path(str(resources.files("seqpar").joinpath("configs")))


def shipped_configs() -> list[str]:
    """Names of the shipped configs, sorted: ``["gpt-1.3b", ..., "paper/175b", ..., "tiny-cpu"]``."""
    root = shipped_dir()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml"))


def _shipped_name(path: str) -> str | None:
    """``tiny-cpu``, ``tiny-cpu.yaml``, ``configs/paper/175b.yaml`` -> the shipped name; None if absolute."""
    pure = PurePosixPath(path.replace("\\", "/"))
    if pure.is_absolute():
        return None
    parts = [p for p in pure.parts if p != "."]
    if parts[:1] == ["configs"]:
        parts = parts[1:]
    if not parts:
        return None
    name = "/".join(parts)
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def resolve_config(path: str | Path) -> Path:
    """An existing file as given; otherwise the shipped config it names; otherwise
    :class:`~seqpar.errors.MissingFile` (a ``FileNotFoundError``).

    ``resolve_config("tiny-cpu")`` and ``resolve_config("configs/paper/175b.yaml")`` (from any
    working directory) give the packaged files. The error lists the shipped names.
    """
    if Path(path).is_file():
        return Path(path)
    name = _shipped_name(str(path))
    names = shipped_configs()
    if name in names:
        return shipped_dir() / f"{name}.yaml"
    raise MissingFile(f"config {str(path)!r} is neither an existing file nor a shipped config; "
                      f"shipped configs: {', '.join(names)}")
