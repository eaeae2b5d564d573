"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, resumable, reshardable.

Layout of ``<dir>/step_00000100/``: the DCP files of ``{"model": dense params, "optim": dense
AdamW moments}``, ``rng_rank{r}.pt`` (each rank's RNG states, tensors only), ``extra.json``
(step, data position, config) and ``config.yaml``. Tensors are stored in the dense,
layout-invariant form of :meth:`GPT.to_dense`, so a checkpoint saved at one TP size loads at any
other; DCP writes each replicated tensor once. (Each rank holds the dense tensors transiently
while saving and loading; models too large for that need a sharded format.)

Atomicity: everything is written to ``step_N.tmp`` and renamed to ``step_N`` only after every
rank finished, then ``latest`` is replaced atomically. A crash mid-save leaves the previous
checkpoint as the newest complete one. Loading reads DCP's metadata with an unpickler that only
admits DCP's own metadata classes, and RNG files with ``weights_only=True``: a checkpoint can
carry no code.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from ..distributed.rng import RNGStreams, capture_rng, restore_rng

PREFIX = "step_"


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the plain data classes DCP's metadata is made of."""

    ALLOWED_PREFIXES = ("torch.distributed.checkpoint.",)
    ALLOWED = {("torch", "Size"), ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
               ("torch", "float32"), ("torch", "float64"), ("torch", "bfloat16"), ("torch", "float16"),
               ("torch", "int64"), ("torch", "int32"), ("torch", "uint8"), ("torch", "bool"), ("torch", "strided"),
               ("torch", "contiguous_format"), ("torch.serialization", "_get_layout"), ("builtins", "getattr"),
               ("torch", "dtype"), ("torch", "layout"), ("torch", "memory_format"),
               ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath")}

    def find_class(self, module: str, name: str):
        if module.startswith(self.ALLOWED_PREFIXES) or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not allowed")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose metadata loading cannot execute code."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        rank = kwargs.get("rank")
        path = Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata")
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        try:
            from torch.distributed.checkpoint.metadata import StorageMeta
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)
        except ImportError:  # older torch without StorageMeta
            pass
        return metadata


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Finished checkpoint folders under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and
                  p.name[len(PREFIX):].isdigit() and (p / "extra.json").is_file())


def latest_checkpoint(root: str | Path) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1] if found else None


def _optimizer_local(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for p, st in optimizer.state.items():
        for key in out:
            if key in st:
                out[key][names[id(p)]] = st[key]
    return out


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, config_yaml: str,
                    streams: RNGStreams | None, keep: int = 2, attachments: dict[str, Path] | None = None) -> Path:
    """Write checkpoint ``step`` atomically; call on every rank. ``attachments`` (name -> file)
    are copied in by rank 0 (e.g. the tokenizer). Returns the final folder."""
    root = Path(root)
    final, tmp = root / f"{PREFIX}{step:08d}", root / f"{PREFIX}{step:08d}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    opt = _optimizer_local(model, optimizer)
    state = {"model": model.dense_state_dict(),
             "optim": {k: model.to_dense(v) for k, v in opt.items()},
             "optim_step": torch.tensor(float(step))}
    dcp.save(state, storage_writer=FileSystemWriter(tmp))
    torch.save(capture_rng(streams), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        for name, src in (attachments or {}).items():
            shutil.copyfile(src, tmp / name)
        (tmp / "extra.json").write_text(json.dumps({"step": step, "world_size": dist.get_world_size()
                                                    if dist.is_initialized() else 1, **extra}, indent=1))
    _barrier()
    if _rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / "latest")
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def load_checkpoint(path: str | Path, model, optimizer, streams: RNGStreams | None) -> dict:
    """Load a checkpoint folder into ``model`` / ``optimizer`` at the current layout (any TP
    size). Restores RNG states when the world size matches. Returns ``extra.json``'s content."""
    path = Path(path)
    extra = json.loads((path / "extra.json").read_text())
    dense = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.dense_state_dict().items()}
    params = dict(model.named_parameters())
    state = {"model": dense, "optim": {k: {n: torch.empty_like(t, dtype=torch.float32 if t.dtype != torch.float64
                                                                 else t.dtype) for n, t in dense.items()}
                                       for k in ("exp_avg", "exp_avg_sq")},
             "optim_step": torch.tensor(0.0)}
    dcp.load(state, storage_reader=SafeReader(path))
    model.load_dense_state_dict(state["model"])
    step_t = state["optim_step"]
    for key in ("exp_avg", "exp_avg_sq"):
        local = model.to_local(state["optim"][key])
        for name, t in local.items():
            p = params[name]
            st = optimizer.state[p]
            st[key] = t.to(p.device, p.dtype).clone()
            st["step"] = step_t.clone()
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = path / f"rng_rank{_rank()}.pt"
    if extra.get("world_size") == world and extra.get("tp") == model.tp_size and rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=True), streams)
    return extra


def load_model_only(path: str | Path, model) -> dict:
    """Load just the model weights (any TP size; works without a process group)."""
    path = Path(path)
    dense = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.dense_state_dict().items()}
    with warnings.catch_warnings():  # one process without a process group is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": dense}, storage_reader=SafeReader(path), no_dist=not dist.is_initialized())
    model.load_dense_state_dict(dense)
    return json.loads((path / "extra.json").read_text())
