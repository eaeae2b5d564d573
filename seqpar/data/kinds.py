"""What a ``data.source`` is: how :func:`seqpar.data.corpus.prepare_corpus` reads it.

* ``None``, a text file, or a folder of text files (searched recursively): ``text``.
* ``.jsonl`` / ``.parquet`` / ``.arrow`` files, or a folder of them (recursively), or a folder
  written by ``datasets.Dataset.save_to_disk`` (``state.json`` beside ``*.arrow``): ``records``.
* one ``.npy`` / ``.bin`` file: ``tokens``; a folder of them (top level): ``shards``.
* a Megatron prefix (``prefix.bin`` + ``prefix.idx``): ``indexed``.

A folder of data files (datasets files or token shards) may hold documentation and metadata beside
them: ``README*``, ``LICENSE*`` / ``LICENCE*``, ``NOTICE*`` and ``*.md`` files, the shards'
``tokenizer.json`` and ``meta.json``, and ``datasets``' own ``state.json``, ``dataset_info.json``.
Those are skipped (:func:`classify` lists them, the corpus logs them). Any other text file beside
data files makes the folder ambiguous, and so do datasets files beside token shards: that is
refused in one line naming both sets, never read as text. Folders in ``exclude`` (a run's output
and checkpoint dirs, the token cache) are never part of a source, wherever they sit.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

from .errors import DataError
from .records import DATASET_DICT, record_files, saved_dataset
from .tokens import TOKEN_SUFFIXES, indexed_prefix, shard_files

TEXT_SUFFIXES = frozenset(".py .txt .md .rst .tex .c .h .cc .cpp .hpp .rs .go .js .ts .java .html .css .json "
                          ".yaml .yml .toml .cfg .ini .csv .sh".split())
DOC_PREFIXES = ("readme", "license", "licence", "notice")  # documentation beside data files
METADATA = frozenset({"meta.json", "tokenizer.json", "state.json", "dataset_info.json"})  # beside data, not text


def resolved(folders: Iterable[str | Path]) -> frozenset[Path]:
    """``folders`` as resolved paths, for comparing with the paths found under a source."""
    return frozenset(Path(p).expanduser().resolve() for p in folders)


def walk_text(root: Path, skip: frozenset[str], excluded: frozenset[Path]) -> list[Path]:
    """Text files under ``root`` (by suffix, sorted), skipping hidden folders, the folder names in
    ``skip`` and the resolved folders in ``excluded``."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip and not d.startswith(".")
                       and Path(dirpath, d).resolve() not in excluded]
        found += [Path(dirpath, f) for f in filenames if Path(f).suffix.lower() in TEXT_SUFFIXES]
    return sorted(found)


def _is_side_file(path: Path) -> bool:
    name = path.name.lower()
    return name.startswith(DOC_PREFIXES) or path.suffix.lower() == ".md" or path.name in METADATA


def _names(root: Path, paths: list[Path], most: int = 3) -> str:
    shown = ", ".join(str(p.relative_to(root)) for p in paths[:most])
    return f"{len(paths)}: {shown}{', ...' if len(paths) > most else ''}"


def _data_folder(path: Path, excluded: frozenset[Path]) -> tuple[str, list[Path]] | None:
    """``(kind, side files)`` of a folder of datasets files or token shards, ``None`` for a text
    folder; ``DataError`` naming both sets when data files share it with other files."""
    if saved_dataset(path):
        return "records", sorted(p for p in path.iterdir() if p.is_file() and _is_side_file(p))
    shards, records = shard_files(path), record_files(path, excluded)
    if not shards and not records:
        return None
    if shards:  # shards are the folder's top-level files; so are the texts that compete with them
        texts = [p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
                 and p.suffix.lower() in TEXT_SUFFIXES]
    else:
        texts = walk_text(path, frozenset({"__pycache__"}), excluded)
    side = [p for p in texts if _is_side_file(p)]
    found = {"token shards": shards, "datasets files": records, "text files": [p for p in texts if p not in side]}
    present = [(what, files) for what, files in found.items() if files]
    if len(present) > 1:
        (a, fa), (b, fb) = present[:2]
        raise DataError(f"data.source={str(path)!r} mixes {a} ({_names(path, fa)}) with {b} ({_names(path, fb)}); "
                        f"a folder holds one kind of data (README*, LICENSE*, NOTICE*, *.md and metadata beside "
                        f"data files are skipped): move the others out, or blend the kinds (data.sources)")
    return ("shards" if shards else "records"), side


def classify(source: str | Path | None, exclude: Iterable[str | Path] = ()) -> tuple[str, list[Path]]:
    """``(kind, side files skipped)``: ``text``, ``records`` (datasets files), ``tokens`` (one
    file), ``shards`` (a folder of token files) or ``indexed`` (Megatron); nothing under the folders
    in ``exclude`` counts. ``DataError`` for a folder of Megatron datasets, a saved
    ``DatasetDict`` or a folder mixing kinds of data."""
    if source is None:
        return "text", []
    path = Path(source).expanduser()
    if indexed_prefix(path) is not None:
        return "indexed", []
    if path.suffix.lower() in TOKEN_SUFFIXES:
        return "tokens", []
    if not path.is_dir():
        return ("records" if record_files(path) else "text"), []
    if any(p.suffix.lower() == ".idx" for p in path.iterdir() if p.is_file()):
        raise DataError(f"data.source={str(source)!r} is a folder of Megatron indexed datasets; name one "
                        f"prefix (data.source=PREFIX) or blend them (data.sources)")
    if (path / DATASET_DICT).is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir() and saved_dataset(p))
        raise DataError(f"data.source={str(source)!r} is a DatasetDict saved with save_to_disk; name one of its "
                        f"splits {splits} (data.source={str(Path(source) / (splits[0] if splits else 'train'))})")
    found = _data_folder(path, resolved(exclude))
    return found if found is not None else ("text", [])


def source_kind(source: str | Path | None, exclude: Iterable[str | Path] = ()) -> str:
    """``text``, ``records``, ``tokens``, ``shards`` or ``indexed`` (:func:`classify`)."""
    return classify(source, exclude)[0]


__all__ = ["TEXT_SUFFIXES", "classify", "resolved", "source_kind", "walk_text"]
