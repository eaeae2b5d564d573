"""Reading DCP checkpoint metadata without running code from it.

DCP stores a checkpoint's index (``.metadata``) as a pickle. :class:`SafeReader` reads it with an
unpickler that resolves only the exact (module, name) pairs in ``_GLOBALS`` (DCP's metadata
dataclasses, ``torch.Size``, plain dtypes, ``pathlib.PosixPath`` and a strided-only layout lookup):
no imports, no attribute lookups (dotted names, ``getattr``), and no BUILD that would set attributes
on a class. :func:`check_metadata` then requires tensor entries only (DCP unpickles bytes entries
with ``weights_only=False``), no stream transforms, and storage paths inside the checkpoint folder;
``SafeReader.read_data`` refuses bytes reads as a second guard. Tensor data is read by DCP with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (_MEM_FORMAT_ENCODING, BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType

from .errors import CheckpointCorrupt, CheckpointError, UnsafeCheckpoint


def capped_repr(value: Any, limit: int = 120) -> str:
    """``repr(value)``, cut to ``limit`` characters for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _cap(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _strided_layout(name: str) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: the strided layout and nothing else."""
    if name != "torch.strided":
        raise UnsafeCheckpoint(f"checkpoint metadata names layout {capped_repr(name)}; only torch.strided "
                                     f"is allowed")
    return torch.strided


_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# The whole of what DCP's metadata pickle may name (read from real checkpoints with pickletools).
_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_DCP_METADATA, c.__name__): c for c in (Metadata, TensorStorageMetadata, BytesStorageMetadata,
                                                TensorProperties, ChunkStorageMetadata, MetadataIndex,
                                                StorageMeta, _MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _strided_layout,
    ("pathlib", "PosixPath"): PosixPath, ("pathlib._local", "PosixPath"): PosixPath,
    **{("torch", str(d).removeprefix("torch.")): d for d in _DTYPES},
}


class _MetadataUnpickler(pickle._Unpickler):  # the Python unpickler, whose BUILD can be guarded
    """Resolves only the exact pairs of ``_GLOBALS``; refuses BUILD on a class object."""

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise UnsafeCheckpoint(f"checkpoint metadata refers to {_cap(f'{module}.{name}')}, "
                                         f"which is not allowed (only DCP's metadata classes, torch.Size and dtypes)")
        return found

    def _load_build(self) -> None:
        if len(self.stack) >= 2 and isinstance(self.stack[-2], type):
            raise UnsafeCheckpoint(f"checkpoint metadata sets attributes of the class "
                                         f"{self.stack[-2].__name__}, which is not allowed")
        pickle._Unpickler.load_build(self)

    dispatch = dict(pickle._Unpickler.dispatch)
    dispatch[pickle.BUILD[0]] = _load_build


def _check_storage(info: Any, root: Path, where: str) -> None:
    if type(info) is not _StorageInfo:
        raise CheckpointCorrupt(f"{where}: storage entry {capped_repr(info)} is not DCP storage info")
    rel = info.relative_path
    parts = PurePosixPath(rel).parts if isinstance(rel, str) else ()
    if (not parts or os.path.isabs(rel) or ".." in parts or
            not (root / rel).resolve().is_relative_to(root)):
        raise CheckpointCorrupt(f"{where}: storage path {capped_repr(rel)} lies outside the checkpoint folder")
    if not all(type(v) is int and v >= 0 for v in (info.offset, info.length)):
        raise CheckpointCorrupt(f"{where}: storage range {capped_repr((info.offset, info.length))} of {rel!r} is not a "
                                f"pair of non-negative integers")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointCorrupt(f"{where}: {rel!r} names stream transforms {capped_repr(info.transform_descriptors)}, "
                                f"which seqpar never writes")


def check_metadata(metadata: Any, folder: str | Path) -> None:
    """Raise :class:`CheckpointCorrupt` (:class:`UnsafeCheckpoint` for bytes entries) unless
    ``metadata`` is DCP metadata seqpar could have written into ``folder``: tensor entries only,
    storage paths inside ``folder``, no stream transforms."""
    folder = Path(folder)
    where = str(folder / ".metadata")
    if type(metadata) is not Metadata:
        raise CheckpointCorrupt(f"{where} holds a {type(metadata).__name__}, not DCP metadata")
    entries, storage = metadata.state_dict_metadata, metadata.storage_data
    if type(entries) is not dict or type(storage) is not dict:
        raise CheckpointCorrupt(f"{where}: state_dict_metadata and storage_data must be dicts")
    for key, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata):
            raise UnsafeCheckpoint(f"{where}: entry {capped_repr(key)} is stored as bytes; seqpar checkpoints "
                                   f"hold only tensors, and DCP would unpickle bytes entries, running any code "
                                   f"they carry")
        if type(entry) is not TensorStorageMetadata or type(entry.properties) is not TensorProperties:
            raise CheckpointCorrupt(f"{where}: entry {capped_repr(key)} is a {type(entry).__name__}, not a tensor")
    root = folder.resolve()
    for index, info in storage.items():
        if type(index) is not MetadataIndex:
            raise CheckpointCorrupt(f"{where}: storage key {capped_repr(index)} is not a DCP metadata index")
        _check_storage(info, root, where)
    if metadata.storage_meta is not None and type(metadata.storage_meta) is not StorageMeta:
        raise CheckpointCorrupt(f"{where}: storage_meta is a {type(metadata.storage_meta).__name__}")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` that reads metadata with the restricted unpickler, checks it
    (:func:`check_metadata`) and refuses to read any bytes entry."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except CheckpointError:
            raise
        except Exception as e:  # a damaged pickle fails in many ways; none runs code (find_class above)
            raise CheckpointCorrupt(f"checkpoint {path} is unreadable ({type(e).__name__})") from None
        check_metadata(metadata, self.path)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, *args: Any, **kwargs: Any) -> None:
        check_metadata(metadata, self.path)
        super().set_up_storage_reader(metadata, *args, **kwargs)

    def read_data(self, plan, planner):
        unasked = [item.dest_index.fqn for item in plan.items if item.type == LoadItemType.BYTE_IO]
        if unasked:
            raise UnsafeCheckpoint(f"checkpoint {self.path}: refusing to read bytes entries {capped_repr(unasked)}")
        return super().read_data(plan, planner)
