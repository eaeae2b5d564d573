"""The safetensors file format, written and read without the ``safetensors`` package: a little-endian
u64 header length, a JSON header (name -> dtype, shape, byte offsets), then the raw data. Nothing in
such a file runs code."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable

import torch

from ..errors import file_error
from .errors import CheckpointCorrupt

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def write_safetensors(path: Path, header: list[tuple[str, tuple[int, ...], torch.dtype]],
                      tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write a safetensors file whose entries ``header`` lists (name, shape, dtype) in order, taking
    the data from ``tensors`` one at a time (they must come in the same order). Atomic: written to
    ``path.tmp`` and renamed."""
    meta, offset = {}, 0
    for name, shape, dtype in header:
        n = torch.Size(shape).numel() * dtype.itemsize
        meta[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    meta["__metadata__"] = {"format": "pt"}
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, shape, dtype), (got, t) in zip(header, tensors, strict=True):
            if got != name or tuple(t.shape) != tuple(shape):
                raise ValueError(f"write_safetensors: expected {name} {tuple(shape)}, got {got} {tuple(t.shape)}")
            data = t.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1).view(torch.uint8)
            f.write(data.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file (header JSON, then raw little-endian data; nothing in it
    runs code). :class:`CheckpointCorrupt` naming the file when the header does not describe its
    bytes; a file that cannot be read is a :class:`~seqpar.errors.UserError` naming it."""
    by_name = {v: k for k, v in _ST_DTYPES.items()}
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise file_error(f"safetensors file {path}", e) from e
    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n])
        out = {}
        for name, entry in meta.items():
            if name == "__metadata__":
                continue
            start, end = entry["data_offsets"]
            dtype, shape = by_name[entry["dtype"]], torch.Size(entry["shape"])
            if end - start != shape.numel() * dtype.itemsize or 8 + n + end > len(data):
                raise ValueError(f"{name}: {end - start} bytes for {entry['dtype']} {list(shape)}")
            raw = bytearray(data[8 + n + start:8 + n + end])
            out[name] = torch.frombuffer(raw, dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
        return out
    except (KeyError, TypeError, ValueError, struct.error) as e:
        raise CheckpointCorrupt(f"{path} is not a readable safetensors file ({e})") from None
