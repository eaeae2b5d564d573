"""Checkpoints with ``torch.distributed.checkpoint`` (DCP): atomic, complete-or-skipped, reshardable.

``<dir>/step_00000100/`` holds the DCP files of ``{"model": dense params, "optim": dense AdamW
moments, "optim_step"}``, ``rng_rank{r}.pt`` (RNG states, tensors only), ``extra.json`` (step, data
position, layout), ``config.yaml``, attachments (``tokenizer.json``) and the completion marker
``complete.json`` = ``{"step": N, "files": {relative path: size in bytes}}``. Tensors are dense and
layout-invariant (:meth:`GPT.to_dense`): a checkpoint saved at one TP size loads at any other.

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
``.metadata`` (a pickle) goes through :mod:`seqpar.train.safe_metadata` (exact (module, name) pairs
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

import fcntl
import json
import os
import re
import shutil
import socket
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ..distributed.rng import RNGStreams, capture_rng, restore_rng
from .safe_metadata import SafeReader, capped_repr, check_metadata

PREFIX = "step_"
MARKER = "complete.json"
LOCK = ".lock"
_STEP = re.compile(r"step_(\d+)")


# ---- completeness ------------------------------------------------------------------------------

def _fsync(path: Path) -> None:
    """Make ``path`` (a file, or a folder's entries) durable."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_of(path: Path) -> int | None:
    m = _STEP.fullmatch(path.name)
    return int(m.group(1)) if m else None


def _seal(folder: Path, step: int) -> None:
    """fsync every file and folder under ``folder``, then write the marker last and fsync it and ``folder``."""
    files: dict[str, int] = {}
    for p in sorted(folder.rglob("*")):
        if p.name != MARKER:
            _fsync(p)
            if p.is_file():
                files[p.relative_to(folder).as_posix()] = p.stat().st_size
    _fsync(folder)
    with open(folder / MARKER, "w") as f:
        json.dump({"step": step, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    _fsync(folder)


def checkpoint_problem(folder: str | Path) -> str | None:
    """Why ``folder`` is not a complete checkpoint (no marker, a listed file missing or of another
    size), or ``None`` when it is."""
    folder = Path(folder)
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER}"
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER} ({e})"
    files = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(files, dict) or not {".metadata", "extra.json"} <= set(files):
        return f"{MARKER} does not list the checkpoint's files"
    if _step_of(folder) is not None and marker.get("step") != _step_of(folder):
        return f"{MARKER} is for step {capped_repr(marker.get('step'))}"
    for name, size in files.items():
        try:
            actual = (folder / name).stat().st_size
        except (OSError, TypeError, ValueError):
            return f"{capped_repr(name)} is missing"
        if actual != size:
            return f"{name} has {actual} bytes, {MARKER} says {capped_repr(size)}"
    return None


def _step_folders(root: Path) -> list[Path]:
    """``step_N`` folders under ``root`` (complete or not), highest step first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _step_of(p) is not None), key=_step_of, reverse=True)


def _pointer(root: Path) -> str | None:
    """The folder name ``latest`` holds, when it names a checkpoint folder."""
    try:
        name = (root / "latest").read_text().strip()
    except OSError:
        return None
    return name if _STEP.fullmatch(name) else None


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, lowest step first (steps compared as integers)."""
    return [p for p in reversed(_step_folders(Path(root))) if checkpoint_problem(p) is None]


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint to resume from: the one ``latest`` names when complete, else the highest-numbered
    complete one; warns naming each incomplete checkpoint it skipped. ``None`` when there is none."""
    root = Path(root)
    named = _pointer(root)
    skipped: list[str] = []
    chosen = None
    for p in sorted(_step_folders(root), key=lambda p: p.name != named):  # stable: then by step, highest first
        problem = checkpoint_problem(p)
        if problem is None:
            chosen = p
            break
        skipped.append(f"checkpoint {p} is incomplete ({problem})")
    for why in skipped:
        warnings.warn(f"{why} and was skipped; using {chosen or 'no checkpoint'}", stacklevel=2)
    return chosen


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


def _optimizer_local(model, optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for p, st in optimizer.state.items():
        for key in out:
            if key in st:
                out[key][names[id(p)]] = st[key]
    return out


def _write_pointer(root: Path, name: str) -> None:
    """Replace ``latest`` atomically (and durably) with ``name``."""
    pointer = root / "latest.tmp"
    with open(pointer, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, root / "latest")
    _fsync(root)


def _commit(root: Path, tmp: Path, final: Path) -> None:
    """Move the sealed ``tmp`` into place as ``final``. An existing ``final`` is set aside first and
    deleted only once the new one is in and ``latest`` names it, so a complete copy always exists."""
    aside = root / f"{final.name}.old"
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync(root)
    _write_pointer(root, final.name)
    shutil.rmtree(aside, ignore_errors=True)


def _prune(root: Path, final: Path, keep: int) -> None:
    """Keep ``keep`` checkpoints: ``final``, the one ``latest`` names, then the highest-numbered
    complete others (steps as integers). ``keep <= 0`` keeps everything."""
    if keep <= 0:
        return
    protected = {final.name, _pointer(root)}
    room = max(keep - sum((root / n).is_dir() for n in protected if n), 0)
    others = [p for p in reversed(complete_checkpoints(root)) if p.name not in protected]
    for old in others[room:]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, config_yaml: str,
                    streams: RNGStreams | None, keep: int = 2, attachments: dict[str, Path] | None = None) -> Path:
    """Write checkpoint ``step`` atomically and durably; call on every rank. ``attachments`` (name ->
    file) are copied in by rank 0 (e.g. the tokenizer). Returns the final folder."""
    root = Path(root)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    opt = _optimizer_local(model, optimizer)
    state = {"model": model.dense_state_dict(),
             "optim": {k: model.to_dense(v) for k, v in opt.items()},
             "optim_step": torch.tensor(float(step))}
    dcp.save(state, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not dist.is_initialized())
    rng_file = tmp / f"rng_rank{_rank()}.pt"
    torch.save(capture_rng(streams), rng_file)
    _fsync(rng_file)  # on a shared filesystem only the writing node can make its file durable
    if _rank() == 0:
        (tmp / "config.yaml").write_text(config_yaml)
        for name, src in (attachments or {}).items():
            shutil.copyfile(src, tmp / name)
        (tmp / "extra.json").write_text(json.dumps({"step": step, "world_size": dist.get_world_size()
                                                    if dist.is_initialized() else 1, **extra}, indent=1))
    _barrier()
    if _rank() == 0:
        _seal(tmp, step)
        _commit(root, tmp, final)
        _prune(root, final, keep)
    _barrier()
    return final


# ---- loading -----------------------------------------------------------------------------------

def _dense_like(model) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.dense_state_dict().items()}


def _reader(path: Path) -> SafeReader:
    """A reader for ``path`` whose metadata was read and checked here, so a hostile checkpoint fails
    with its own error on every rank before DCP's collectives."""
    reader = SafeReader(path)
    reader.read_metadata()
    return reader


def load_checkpoint(path: str | Path, model, optimizer, streams: RNGStreams | None) -> dict:
    """Load a complete checkpoint folder into ``model`` / ``optimizer`` at the current layout (any TP
    size). Restores RNG states when the world size matches. Returns ``extra.json``'s content.
    Raises ``ValueError`` for an incomplete checkpoint and for metadata seqpar would not write."""
    path = Path(path)
    extra = _require_complete(path)
    reader = _reader(path)
    dense = _dense_like(model)
    params = dict(model.named_parameters())
    state = {"model": dense, "optim": {k: {n: torch.empty_like(t, dtype=torch.float32 if t.dtype != torch.float64
                                                                 else t.dtype) for n, t in dense.items()}
                                       for k in ("exp_avg", "exp_avg_sq")},
             "optim_step": torch.tensor(0.0)}
    dcp.load(state, storage_reader=reader)
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


# ---- one job per checkpoint dir ----------------------------------------------------------------

class CheckpointDir:
    """A job's hold on its checkpoint dir (see :func:`open_checkpoint_dir`); :meth:`close` releases it."""

    def __init__(self, root: Path):
        self.root = root
        self._lock_file = None  # open and flock-ed on the first rank

    def lock(self) -> None:
        """Take the exclusive lock or raise ``RuntimeError`` naming the holder (host, pid, since)."""
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / LOCK, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read(400).strip() or "unknown holder"
            f.close()
            raise RuntimeError(f"checkpoint dir {self.root} is in use by another job ({holder}); two jobs must "
                               f"not share checkpoint.dir: give this one its own or stop the other") from None
        except OSError as e:
            f.close()
            raise RuntimeError(f"cannot lock checkpoint dir {self.root} ({e}); multi-node runs need a shared "
                               f"filesystem with flock support for checkpoint.dir") from e
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        f.flush()
        self._lock_file = f

    def close(self) -> None:
        """Release the lock (idempotent)."""
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def __enter__(self) -> CheckpointDir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clean(root: Path) -> None:
    """Remove ``step_N.tmp`` folders and ``latest.tmp`` left by crashed saves; put back a
    ``step_N.old`` whose replacement never arrived (delete it when ``step_N`` exists)."""
    for p in root.iterdir():
        base = root / p.name.rsplit(".", 1)[0]
        if p.name == "latest.tmp":
            p.unlink()
        elif p.is_dir() and p.suffix == ".tmp" and _step_of(base) is not None:
            shutil.rmtree(p)
        elif p.is_dir() and p.suffix == ".old" and _step_of(base) is not None:
            if base.exists():
                shutil.rmtree(p)
            else:
                os.replace(p, base)
    _fsync(root)


def open_checkpoint_dir(root: str | Path, is_first: bool) -> CheckpointDir:
    """Claim ``root`` for this job; call on every rank at start-up (a collective when distributed).
    The first rank (global rank 0) creates ``root``, takes an exclusive ``flock`` on ``root/.lock``
    held until :meth:`CheckpointDir.close`, and cleans up after crashed saves (:func:`_clean`). If
    another job holds the lock, every rank raises ``RuntimeError`` naming it (host, pid)."""
    handle, error = CheckpointDir(Path(root)), None
    if is_first:
        try:
            handle.lock()
            _clean(handle.root)
        except Exception as e:  # reported on every rank below, so no rank waits in a collective
            handle.close()
            error = e
    if dist.is_initialized():
        messages: list = [None] * dist.get_world_size()
        dist.all_gather_object(messages, None if error is None else str(error))
        failed = next((m for m in messages if m is not None), None)
        if failed is not None and error is None:
            handle.close()
            raise RuntimeError(failed)
    if error is not None:
        raise error
    return handle
