"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, complete-or-skipped, reshardable.

``<dir>/step_00000100/`` holds the DCP files of ``model.<name>`` (parameters), ``optim.exp_avg.<name>``,
``optim.exp_avg_sq.<name>`` (AdamW moments) and ``optim_step``, ``rng_rank{r}.pt`` (RNG states,
tensors only), ``extra.json`` (step, data position, layout), ``config.yaml``, attachments
(``tokenizer.json``) and the completion marker ``complete.json`` = ``{"step": N, "files":
{relative path: size in bytes}}``. Tensors are described by their dense, layout-invariant names
and shapes (:meth:`GPT.dense_state_dict`) but written sharded: each rank writes only the pieces it
holds and reads only the pieces it needs (:mod:`seqpar.checkpoint.pieces`), so no rank ever
holds another rank's shard, and a checkpoint saved at one (tp, dp, data_parallel) layout loads at
any other.

Asynchronous saves (``checkpoint.async``): :func:`save_checkpoint` with ``async_save=True`` returns
a :class:`PendingCheckpoint` once the tensors are copied off the parameters (``dcp.async_save``
writes them in the background over its own gloo group); :meth:`PendingCheckpoint.finish` (every
rank; the next save or the end of the run calls it) waits for the files and then seals and
commits the folder exactly as a synchronous save does.

Complete or skipped. All files go to ``step_N.tmp``; each rank fsyncs what it wrote, rank 0 fsyncs
every file, writes the marker last, fsyncs it and the folder, renames the folder to ``step_N`` (an
existing ``step_N`` is renamed to ``step_N.old`` first and deleted only once the new one is in) and
replaces ``latest`` atomically. A checkpoint counts only if every file the marker lists has the
listed size; :func:`latest_checkpoint` takes the one ``latest`` names, else the highest-numbered
complete one, warning about each one it skips. keep-N keeps the checkpoint just written, the one
``latest`` names and the highest-numbered complete others (steps compared as integers).

One job per dir. :func:`open_checkpoint_dir` (every rank, at start-up) has global rank 0 hold an
exclusive ``fcntl.flock`` on ``<dir>/.lock`` for the job's lifetime, delete ``*.tmp`` folders of
crashed saves and restore a ``step_N.old`` whose replacement never arrived; a second job on the dir
fails on every rank naming the holder (host, pid). Multi-node runs need ``checkpoint.dir`` on a
filesystem shared by all nodes (every rank writes into the same folder) with ``flock`` across
clients (NFSv4; Lustre mounted with ``-o flock``).

Trust. A checkpoint folder is untrusted input and loading it runs no code from it:
``.metadata`` (a pickle) goes through :mod:`seqpar.checkpoint.safe_metadata` (exact (module, name) pairs
of DCP's metadata classes, ``torch.Size``, dtypes, ``PosixPath``; no imports, attribute lookups or
``getattr``; tensor entries only, since DCP unpickles bytes entries with ``weights_only=False``;
storage paths confined to the folder); tensor data and RNG files are read with
``torch.load(weights_only=True)``, ``extra.json`` as JSON, ``config.yaml`` (by ``seqpar
generate``) with the safe YAML loader, ``tokenizer.json`` by ``tokenizers``. Trusted: the installed
Python, torch and seqpar code. Not vouched for: the values (weights, data position, config,
tokenizer), which a crafted checkpoint may set to anything; ``complete.json`` detects torn writes,
not tampering.
"""
from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..distributed.rng import RNGStreams, capture_rng, restore_rng
from .files import (PREFIX, _commit, _fsync, _prune, _seal, checkpoint_problem, complete_checkpoints,
                               latest_checkpoint, open_checkpoint_dir)
from .safe_metadata import SafeReader
from .pieces import PartsLoadPlanner, PartsSavePlanner, optimizer_moments, training_parts

def _require_complete(path: Path) -> dict:
    """``extra.json`` of a complete checkpoint; ``ValueError`` naming the folder otherwise."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is incomplete: {problem}")
    try:
        return json.loads((path / "extra.json").read_text())
    except ValueError as e:
        raise ValueError(f"checkpoint {path}: extra.json is not JSON ({e})") from None


# ---- saving ------------------------------------------------------------------------------------

def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, config_yaml: str,
                    streams: RNGStreams | None, keep: int = 2, attachments: dict[str, Path] | None = None,
                    *, async_save: bool = False):
    """Write checkpoint ``step`` atomically and durably; call on every rank. ``attachments`` (name ->
    file) are copied in by rank 0 (e.g. the tokenizer). Returns the final folder, or with
    ``async_save`` a :class:`PendingCheckpoint` whose ``finish()`` returns it."""
    root = Path(root)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    parts = training_parts(model, optimizer)
    state = {"optim_step": torch.tensor(float(step))}
    writer = FileSystemWriter(tmp, sync_files=True)
    if async_save:
        future = dcp.async_save(state, storage_writer=writer, planner=PartsSavePlanner(parts, copy=True),
                                process_group=_async_group())
    else:
        dcp.save(state, storage_writer=writer, planner=PartsSavePlanner(parts), no_dist=not dist.is_initialized())
        future = None
    rng_file = tmp / f"rng_rank{_rank()}.pt"
    torch.save(_capture(streams), rng_file)
    _fsync(rng_file)  # on a shared filesystem only the writing node can make its file durable
    if _rank() == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        for name, src in (attachments or {}).items():
            shutil.copyfile(src, tmp / name)
        (tmp / "extra.json").write_text(json.dumps({"step": step, "world_size": dist.get_world_size()
                                                    if dist.is_initialized() else 1, **extra}, indent=1))
    pending = PendingCheckpoint(root, tmp, final, step, keep, future)
    return pending if async_save else pending.finish()


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else ([] if x is None else [x])


def _capture(streams) -> dict:
    """RNG snapshot: torch's generators and the first streams (:func:`capture_rng`), plus the
    states of further streams (one per pipeline stage on this rank)."""
    streams = _as_list(streams)
    snap = capture_rng(streams[0] if streams else None)
    snap["more_streams"] = [s.get_state() for s in streams[1:]]
    return snap


def _restore(snap: dict, streams) -> None:
    streams = _as_list(streams)
    restore_rng(snap, streams[0] if streams else None)
    for s, state in zip(streams[1:], snap.get("more_streams", [])):
        s.set_state(state)


_ASYNC_GROUP: list = []


def _async_group():
    """A gloo group of the whole world for the background writes' collectives (never the training
    group, which the main thread keeps using meanwhile)."""
    if not dist.is_initialized():
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


class PendingCheckpoint:
    """A checkpoint whose files may still be being written; :meth:`finish` (every rank) waits for
    them, then rank 0 seals, commits and prunes (keep-N), and returns the final folder."""

    def __init__(self, root: Path, tmp: Path, final: Path, step: int, keep: int, future=None):
        self.root, self.tmp, self.final, self.step, self.keep, self.future = root, tmp, final, step, keep, future

    def finish(self) -> Path:
        if self.future is not None:
            self.future.result()
            self.future = None
        _barrier()
        if _rank() == 0:
            _seal(self.tmp, self.step)
            _commit(self.root, self.tmp, self.final)
            _prune(self.root, self.final, self.keep)
        _barrier()
        return self.final


# ---- loading -----------------------------------------------------------------------------------

def _dense_like(model) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.dense_state_dict().items()}


def _reader(path: Path) -> SafeReader:
    """A reader for ``path`` whose metadata was read and checked here, so a hostile checkpoint fails
    with its own error on every rank before DCP's collectives."""
    reader = SafeReader(path)
    reader.read_metadata()
    return reader


@torch.no_grad()
@torch.no_grad()
def load_checkpoint(path: str | Path, model, optimizer, streams) -> dict:
    """Load a complete checkpoint folder into ``model`` (the GPT, or a list of this rank's pipeline
    stages) and ``optimizer`` at the current layout (any tp, dp, pp and data_parallel), each rank
    reading only the pieces of the dense tensors it holds. Restores RNG states (``streams``: one
    RNGStreams or a list, one per stage) when the layout matches. Returns ``extra.json``'s
    content. Raises ``ValueError`` for an incomplete checkpoint and for metadata seqpar would not write."""
    path = Path(path)
    extra = _require_complete(path)
    reader = _reader(path)
    modules = _as_list(model)
    for module in modules:
        optimizer_moments(module, optimizer, create=True, step=float(extra.get("step", 0)))
    state = {"optim_step": torch.tensor(0.0)}
    dcp.load(state, storage_reader=reader, planner=PartsLoadPlanner(training_parts(modules, optimizer)))
    for st in optimizer.state.values():
        st["step"].fill_(float(state["optim_step"]))
    world = dist.get_world_size() if dist.is_initialized() else 1
    rng_file = path / f"rng_rank{_rank()}.pt"
    layout = (modules[0].tp_size, len(modules), getattr(modules[0], "num_stages", 1))
    saved = (extra.get("tp"), extra.get("virtual_stages", 1), extra.get("pp", 1) * extra.get("virtual_stages", 1))
    if extra.get("world_size") == world and saved == layout and rng_file.is_file():
        _restore(torch.load(rng_file, weights_only=True), streams)
    return extra


def load_model_only(path: str | Path, model) -> dict:
    """Load just the model weights of a complete checkpoint (any TP size; works without a process group)."""
    path = Path(path)
    extra = _require_complete(path)
    reader = _reader(path)
    dense = _dense_like(model)
    with warnings.catch_warnings():  # one process without a process group is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": dense}, storage_reader=reader, no_dist=not dist.is_initialized())
    model.load_dense_state_dict(dense)
    return extra


# the filesystem side (checkpoint_files) is re-exported: callers import checkpoints from here
__all__ = ["PendingCheckpoint", "SafeReader", "checkpoint_problem", "complete_checkpoints", "latest_checkpoint",
           "load_checkpoint", "load_model_only", "open_checkpoint_dir", "save_checkpoint"]
