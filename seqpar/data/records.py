"""Hugging Face ``datasets`` files on disk as text sources: ``.jsonl``, ``.parquet``, ``.arrow``
(one file, or a folder of them), or a folder written by ``datasets.Dataset.save_to_disk``
(``state.json`` beside its ``*.arrow`` files, opened in place with ``datasets.load_from_disk``),
read with the ``datasets`` library (the ``data`` extra: ``pip install seqpar[data]``); the text of
each record is its ``data.text_field`` column. Records are read a batch at a time from the
memory-mapped Arrow table, never all at once.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from .errors import DataError
from .text import TextInput

RECORD_SUFFIXES = {".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
BATCH = 1000  # records per encode_batch call
SAVED_STATE = "state.json"  # beside the .arrow files of a Dataset.save_to_disk folder
DATASET_DICT = "dataset_dict.json"  # a DatasetDict.save_to_disk folder: one subfolder per split


def saved_dataset(folder: Path) -> bool:
    """``folder`` was written by ``datasets.Dataset.save_to_disk``: ``state.json`` beside ``*.arrow``."""
    return (folder.is_dir() and (folder / SAVED_STATE).is_file()
            and any(p.suffix.lower() == ".arrow" for p in folder.iterdir() if p.is_file()))


def record_files(source: Path, excluded: frozenset[Path] = frozenset()) -> list[Path]:
    """The dataset files of ``source`` (a file or a folder holding only one kind of them), none
    under a hidden folder or a resolved folder of ``excluded``; [] if none."""
    if source.is_file():
        return [source] if source.suffix.lower() in RECORD_SUFFIXES else []
    if not source.is_dir():
        return []
    return sorted(p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in RECORD_SUFFIXES
                  and not any(part.startswith(".") for part in p.relative_to(source).parts)
                  and not (excluded and excluded.intersection(p.resolve().parents)))


def _load(files: list[Path], cache_dir: Path):
    """The dataset of ``files`` (memory-mapped): ``load_from_disk`` of a save_to_disk folder, else
    ``load_dataset`` of the files, which ``datasets`` converts into ``cache_dir`` once."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.source={str(files[0])!r} is a {files[0].suffix} dataset file; reading it needs the "
                        f"datasets package (pip install seqpar[data])") from None
    kinds = {RECORD_SUFFIXES[p.suffix.lower()] for p in files}
    if len(kinds) > 1:
        raise DataError(f"data.source: one folder mixes dataset formats {sorted(kinds)}; keep one per source")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only, never the network
    datasets.disable_progress_bars()
    folder = files[0].parent
    try:
        if saved_dataset(folder) and set(files) == {p for p in folder.iterdir() if p.suffix.lower() == ".arrow"}:
            return datasets.load_from_disk(str(folder))  # in place, in the order its state.json lists
        return datasets.load_dataset(kinds.pop(), data_files=[str(p) for p in files], split="train",
                                     cache_dir=str(cache_dir))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for a bad file
        raise DataError(f"dataset {str(files[0])!r}{' (and others)' if len(files) > 1 else ''} is unreadable "
                        f"({type(e).__name__}: {str(e)[:200]})") from None


@dataclass(frozen=True)
class RecordPiece:
    """Records ``[lo, hi)`` of a loaded dataset (memory-mapped; pickles by reference to its files)."""

    column: Any  # a datasets.Dataset holding only the text column
    field: str
    lo: int
    hi: int
    name: str  # the first dataset file, for errors
    nbytes: int  # an estimate, for the progress lines

    @property
    def documents(self) -> int:
        return self.hi - self.lo

    def texts(self) -> Iterator[list[str]]:
        texts = self.column[self.lo:self.hi][self.field]
        bad = next((j for j, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise DataError(f"dataset {self.name!r}: record {self.lo + bad} has data.text_field={self.field!r} of "
                            f"type {type(texts[bad]).__name__}, not a string")
        yield texts


def record_input(files: list[Path], text_field: str, cache_dir: Path) -> TextInput:
    """The records of ``files`` as documents (their ``text_field`` strings), checked up front."""
    table = _load(files, cache_dir)
    if text_field not in table.column_names:
        raise DataError(f"dataset {str(files[0])!r} has no column data.text_field={text_field!r} "
                        f"(columns: {table.column_names})")
    column, n = table.select_columns([text_field]), len(table)
    if n == 0:
        raise DataError(f"dataset {str(files[0])!r} holds no records")
    per_record = sum(p.stat().st_size for p in files) / n  # the files' size: a progress estimate only
    return TextInput(tuple(RecordPiece(column, text_field, lo, min(lo + BATCH, n), str(files[0]),
                                       int(per_record * (min(lo + BATCH, n) - lo))) for lo in range(0, n, BATCH)))
