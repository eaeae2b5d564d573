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
listed size and checksum (:mod:`seqpar.checkpoint.integrity`); :func:`latest_checkpoint` takes the
newest save (the marker's sequence number; ``latest`` is advisory), logging a line for each incomplete
one it skips; :func:`~seqpar.checkpoint.resume.resume_latest` also falls back past one whose files
fail their checksums. keep-N keeps the checkpoint just written, the next newest saves and the one
the caller pins (the trainer's last good checkpoint). A file that cannot be written (a full disk)
fails the save on every rank in one line naming it
(:class:`~seqpar.checkpoint.errors.CheckpointWriteError`); the previous checkpoints stay.

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
tokenizer), which a crafted checkpoint may set to anything; ``complete.json``'s sizes and CRC-32s
detect torn writes and damaged bytes, not tampering. A file that cannot be read or parsed raises
:class:`~seqpar.checkpoint.errors.CheckpointCorrupt` naming it.
"""
from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..distributed.collectives import group_rank, group_size, new_group, world_group
from ..distributed.rng import RNGStreams, capture_streams, restore_streams
from .compat import check_compatible
from .errors import (CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointWriteError,
                     IncompleteTrainingState, write_error)
from .files import (PREFIX, _commit, _fsync, _prune, _seal, checkpoint_problem, complete_checkpoints,
                    latest_checkpoint, open_checkpoint_dir, recorded_checksums, to_stderr)
from .integrity import agree, checksums, file_checksum, gather_dicts, verify_files
from .pieces import (PartsLoadPlanner, PartsSavePlanner, StagingBuffers, coverage_problem, optimizer_moments,
                     training_parts)
from .safe_metadata import SafeReader
from .writer import ChecksumWriter, own_error


def _open(path: Path, verify: bool) -> dict:
    """``extra.json`` of a complete checkpoint whose files (with ``verify``) match their checksums;
    :class:`CheckpointCorrupt` naming the folder or file otherwise. Every rank gets the same answer."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise CheckpointCorrupt(f"checkpoint {path} is incomplete: {problem}")
    if verify:
        problem = verify_files(path, recorded_checksums(path), shared=world_group() is not None)
        if problem is not None:
            raise CheckpointCorrupt(f"checkpoint {problem}")
    try:
        extra = json.loads((path / "extra.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointCorrupt(f"checkpoint {path / 'extra.json'} is unreadable ({type(e).__name__})") from None
    if not isinstance(extra, dict):
        raise CheckpointCorrupt(f"checkpoint {path / 'extra.json'} does not hold a mapping")
    return extra


# ---- saving ------------------------------------------------------------------------------------

_ONE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"  # DCP's notice, below


@contextmanager
def _one_process() -> Iterator[None]:
    """Without a process group DCP warns on each save and load that it assumes one process: that is
    the intent here (one-process runs, ``seqpar generate``), so that one notice is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        yield


def _one_process_in_background() -> None:
    """The same notice from ``dcp.async_save``'s writer thread, which warns after the call has
    returned, where no ``catch_warnings`` around the call reaches: ignored for good, that message
    from DCP's modules only (a one-process background save; with a process group it never comes)."""
    warnings.filterwarnings("ignore", message=_ONE_PROCESS, module=r"torch\.distributed\.checkpoint\.")


def _rank() -> int:
    return group_rank(world_group())


def _discard(tmp: Path) -> None:
    """Rank 0 deletes the folder of a failed save, giving back the space its files took."""
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)


def _make_tmp(tmp: Path) -> None:
    """Rank 0 makes the empty ``tmp``; every rank raises if it could not (this is their barrier)."""
    problem = None
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(parents=True)
        except OSError as e:
            problem = str(write_error(e, tmp))
    problem = agree(problem)
    if problem is not None:
        raise CheckpointWriteError(problem)


def _write_own_files(tmp: Path, step: int, extra: dict, config_yaml: str, streams,
                     attachments: dict[str, Path] | None) -> tuple[dict[str, str], str | None]:
    """This rank's RNG file (rank 0 also config.yaml, the attachments, extra.json): their
    checksums, and the one-line error of a write that failed (reported at ``finish``)."""
    current = tmp / f"rng_rank{_rank()}.pt"
    try:
        torch.save(capture_streams(_as_list(streams)), current)
        _fsync(current)  # on a shared filesystem only the writing node can make its file durable
        sums = {current.name: file_checksum(current)}
        if _rank() == 0:
            current = tmp / "config.yaml"
            current.write_text(config_yaml)
            for name, src in (attachments or {}).items():
                current = tmp / name
                shutil.copyfile(src, current)
            current = tmp / "extra.json"
            current.write_text(json.dumps({"step": step, "world_size": group_size(world_group()), **extra},
                                          indent=1))
    except (OSError, RuntimeError) as e:
        error = write_error(e, current)
        if error is None:
            raise
        return {}, str(error)
    return sums, None


def save_checkpoint(root: str | Path, step: int, model, optimizer, extra: dict, config_yaml: str,
                    streams: RNGStreams | None, keep: int = 2, attachments: dict[str, Path] | None = None,
                    *, async_save: bool = False, pinned: Path | None = None):
    """Write checkpoint ``step`` atomically and durably; call on every rank. ``attachments`` (name ->
    file) are copied in by rank 0 (e.g. the tokenizer). keep-N keeps this one, the ``keep - 1``
    newest others and ``pinned`` (a checkpoint never pruned). Returns the final folder, or with
    ``async_save`` a :class:`PendingCheckpoint` whose ``finish()`` returns it. A file that cannot
    be written raises :class:`CheckpointWriteError` on every rank, naming it."""
    root = Path(root)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f"{final.name}.tmp"
    problem = agree(coverage_problem(model, optimizer))  # every rank, before anything is written
    if problem is not None:
        raise IncompleteTrainingState(f"checkpoint step {step} not written: {problem}")
    _make_tmp(tmp)
    parts = training_parts(model, optimizer)
    state = {"optim_step": torch.tensor(float(step))}
    writer, staging = ChecksumWriter(tmp), None
    try:
        if async_save:
            staging = None if _STAGING.busy else _STAGING  # fresh buffers while an earlier save still reads them
            planner = PartsSavePlanner(parts, copy=True, staging=staging)
            _STAGING.busy = _STAGING.busy or staging is not None
            try:
                if world_group() is None:
                    _one_process_in_background()
                with _one_process():
                    future = dcp.async_save(state, storage_writer=writer, planner=planner,
                                            process_group=_async_group())
            except BaseException:
                _STAGING.busy = _STAGING.busy and staging is None
                raise
        else:
            with _one_process():
                dcp.save(state, storage_writer=writer, planner=PartsSavePlanner(parts),
                         no_dist=world_group() is None)
            future = None
    except CheckpointException as e:
        _discard(tmp)
        raise own_error(e) from None
    sums, error = _write_own_files(tmp, step, extra, config_yaml, streams, attachments)
    pending = PendingCheckpoint(root, tmp, final, step, keep, future, writer=writer, sums=sums, error=error,
                                pinned=pinned)
    pending.owns_staging = async_save and staging is not None
    return pending if async_save else pending.finish()


def _as_list(x) -> list:
    return list(x) if isinstance(x, (list, tuple)) else ([] if x is None else [x])


_ASYNC_GROUP: list = []
_STAGING = StagingBuffers()  # the background saves' CPU snapshots, allocated once per process


def _async_group():
    """A gloo group of the whole world for the background writes' collectives (never the training
    group, which the main thread keeps using meanwhile)."""
    if world_group() is None:
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


class PendingCheckpoint:
    """A checkpoint whose files may still be being written; :meth:`finish` (every rank) waits for
    them, gathers every rank's checksums, then rank 0 seals, commits and prunes (keep-N, sparing
    ``pinned``), and returns the final folder. A failed write raises :class:`CheckpointWriteError`
    on every rank."""

    def __init__(self, root: Path, tmp: Path, final: Path, step: int, keep: int, future=None, *,
                 writer: ChecksumWriter | None = None, sums: dict | None = None, error: str | None = None,
                 pinned: Path | None = None):
        self.root, self.tmp, self.final, self.step, self.keep, self.future = root, tmp, final, step, keep, future
        self.pinned = pinned
        self.writer, self.sums, self.error = writer, dict(sums or {}), error
        self.owns_staging = False  # whether finishing frees the reused staging buffers

    def _shard_sums(self) -> dict[str, str]:
        """This rank's shard checksums (taken by the writer; read here when it ran elsewhere)."""
        if self.writer is not None and self.writer.sums:
            return self.writer.sums
        return checksums(self.tmp, [p.name for p in self.tmp.glob(f"__{_rank()}_*.distcp")])

    def finish(self) -> Path:
        if self.future is not None:
            future, self.future = self.future, None
            try:
                future.result()
            except CheckpointException as e:
                _discard(self.tmp)
                raise own_error(e) from None
            finally:
                if self.owns_staging:
                    _STAGING.busy = False  # the writes are done with the snapshots
        problem = agree(self.error)
        if problem is not None:
            _discard(self.tmp)
            raise CheckpointWriteError(problem)
        sums = gather_dicts({**self._shard_sums(), **self.sums})
        if _rank() == 0:
            try:
                _seal(self.tmp, self.step, sums)
                _commit(self.root, self.tmp, self.final)
                _prune(self.root, self.final, self.keep, self.pinned)
            except CheckpointError as e:
                problem = str(e)
                _discard(self.tmp)  # gone already once the rename happened
        problem = agree(problem)
        if problem is not None:
            raise CheckpointWriteError(problem)
        return self.final


# ---- loading -----------------------------------------------------------------------------------

def _dense_like(model) -> dict[str, torch.Tensor]:
    return {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.dense_state_dict().items()}


def _reader(path: Path) -> tuple[SafeReader, set[str]]:
    """A reader for ``path`` whose metadata was read and checked here, so a hostile checkpoint fails
    with its own error on every rank before DCP's collectives; and the saved tensors' names."""
    reader = SafeReader(path)
    return reader, set(reader.read_metadata().state_dict_metadata)


def _refuse_unused(path: Path, saved: set[str], used: set[str]) -> None:
    """:class:`CheckpointMismatch` naming the saved tensors no rank's model uses (same on every rank)."""
    unused = sorted(saved - gather_dicts(dict.fromkeys(used)).keys())
    if unused:
        more = f" and {len(unused) - 6} more" if len(unused) > 6 else ""
        raise CheckpointMismatch(f"checkpoint {path} holds tensors this model does not have: "
                                 f"{', '.join(unused[:6])}{more}; it was saved from another model")


def _dcp_load(path: Path, state: dict, **kwargs) -> None:
    """``dcp.load`` whose failures become one-line errors: a tensor the model needs in another
    shape or missing (:class:`CheckpointMismatch`), unreadable data (:class:`CheckpointCorrupt`)."""
    try:
        with _one_process():
            dcp.load(state, **kwargs)
    except CheckpointException as e:
        exc = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(exc, CheckpointError):
            raise exc from None
        if isinstance(exc, ValueError) and "checkpoint" in str(exc):
            raise CheckpointMismatch(f"checkpoint {path}: {exc}") from None
        raise CheckpointCorrupt(f"checkpoint {path}: the tensor data is unreadable ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:160] if str(exc) else ''})") from None


def _load_rng(path: Path, extra: dict, modules: list, streams) -> str | None:
    """Restore this rank's RNG states when the layout matches the saved one; an unreadable RNG
    file on any rank raises :class:`CheckpointCorrupt` on every rank, naming it. Returns the line
    saying the dropout streams were reseeded (saved on another device type), else ``None``."""
    world = group_size(world_group())
    rng_file = path / f"rng_rank{_rank()}.pt"
    cp = getattr(getattr(modules[0], "cp", None), "size", 1)  # context parallelism: ranks' roles differ too
    layout = (modules[0].tp_size, len(modules), getattr(modules[0], "num_stages", 1), cp)
    saved = (extra.get("tp"), extra.get("virtual_stages", 1), extra.get("pp", 1) * extra.get("virtual_stages", 1),
             extra.get("cp", 1))
    problem = note = None
    if extra.get("world_size") == world and saved == layout and rng_file.is_file():
        try:
            note = restore_streams(torch.load(rng_file, weights_only=True), _as_list(streams))
        except Exception as e:  # any parse failure of a damaged file; nothing in it runs (weights_only)
            problem = f"checkpoint {rng_file} is unreadable ({type(e).__name__}); it holds RNG states only"
    problem = agree(problem)
    if problem is not None:
        raise CheckpointCorrupt(problem)
    return note


@torch.no_grad()
def load_checkpoint(path: str | Path, model, optimizer, streams, *, config=None, data: dict | None = None,
                    verify: bool = True, log: Callable[[str], None] = to_stderr) -> dict:
    """Load a complete checkpoint folder into ``model`` (the GPT, or a list of this rank's pipeline
    stages) and ``optimizer`` at the current layout (any tp, dp, pp and data_parallel), each rank
    reading only the pieces of the dense tensors it holds. Restores RNG states (``streams``: one
    RNGStreams or a list, one per stage) when the layout matches. Returns ``extra.json``'s content.

    ``verify``: check every file against its recorded checksum first. ``config`` (the new run's
    ``RunConfig``) and ``data`` (its :func:`~seqpar.checkpoint.compat.data_identity`): refuse a
    checkpoint of another model or data (:func:`~seqpar.checkpoint.compat.check_compatible`).
    ``log`` gets the line saying the dropout streams were reseeded when they were saved on another
    device type (a GPU checkpoint resumed on a CPU). Raises :class:`CheckpointCorrupt` for an
    incomplete, damaged or unreadable checkpoint,
    :class:`CheckpointMismatch` for another model (saved tensors this model does not use
    included), both one-line ``ValueError`` s naming the folder or file."""
    path = Path(path)
    extra = _open(path, verify)
    if config is not None:
        check_compatible(path, config, data, extra)
    reader, saved = _reader(path)
    modules = _as_list(model)
    for module in modules:
        optimizer_moments(module, optimizer, create=True, step=float(extra.get("step", 0)))
    parts = training_parts(modules, optimizer)
    _refuse_unused(path, saved, {*parts, "optim_step"})
    state = {"optim_step": torch.tensor(0.0)}
    _dcp_load(path, state, storage_reader=reader, planner=PartsLoadPlanner(parts))
    for st in optimizer.state.values():
        st["step"].fill_(float(state["optim_step"]))
    note = _load_rng(path, extra, modules, streams)
    if note is not None:
        log(f"checkpoint {path}: {note}")
    return extra


def load_model_only(path: str | Path, model, *, verify: bool = True) -> dict:
    """Load just the model weights of a complete checkpoint (any TP size; works without a process
    group); ``verify`` checks every file's checksum first. Errors as :func:`load_checkpoint`'s."""
    path = Path(path)
    extra = _open(path, verify)
    reader, saved = _reader(path)
    dense = _dense_like(model)
    _refuse_unused(path, {k for k in saved if k.startswith("model.")}, {f"model.{k}" for k in dense})
    _dcp_load(path, {"model": dense}, storage_reader=reader, no_dist=world_group() is None)
    model.load_dense_state_dict(dense)
    return extra


# the filesystem side (checkpoint_files) is re-exported: callers import checkpoints from here
__all__ = ["PendingCheckpoint", "SafeReader", "checkpoint_problem", "complete_checkpoints", "latest_checkpoint",
           "load_checkpoint", "load_model_only", "open_checkpoint_dir", "save_checkpoint"]
