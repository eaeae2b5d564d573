"""Checkpoints run no code on load, keep the newest state, are complete or skipped, and one job owns a dir.

The hostile checkpoints here are built by hand: metadata pickles assembled opcode by opcode, and
real checkpoints whose metadata is rewritten. Each one tries to create a marker file; loading
must raise a clear error and the marker must never appear.
"""
import json
import os
import pickle
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqpar.model import GPT, GPTConfig
from seqpar.checkpoint import save_load as ck
from seqpar.train.optim import build_optimizer

MARKER = "complete.json"  # the completion marker: {"step": N, "files": {path: bytes}, "crc32": {path: hex}, ...}


# ---- building checkpoints ----------------------------------------------------------------------

def _model() -> tuple[GPT, torch.optim.Optimizer]:
    """A tiny GPT after one AdamW step (so the optimizer has moments to save)."""
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1), seed=0)
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    opt.step()
    return model, opt


def _save(root: Path, step: int, keep: int = 0, model_opt=None) -> Path:
    model, opt = model_opt or _model()
    return ck.save_checkpoint(root, step, model, opt, {"tp": 1}, "train: {}\n", model.rng, keep=keep)


@pytest.fixture(scope="module")
def tiny():
    return _model()


def _reseal(folder: Path) -> None:
    """Rewrite the completion marker for the folder's current files, as an attacker could."""
    files = {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
             if p.is_file() and p.name != MARKER}
    step = int(folder.name.split("_")[1].split(".")[0])
    (folder / MARKER).write_text(json.dumps({"step": step, "files": files}))


def _rewrite_metadata(folder: Path, change) -> None:
    """Load the (trusted, test-made) metadata with plain pickle, let ``change`` edit it, store it back."""
    path = folder / ".metadata"
    md = pickle.loads(path.read_bytes())
    change(md)
    path.write_bytes(pickle.dumps(md, protocol=4))
    _reseal(folder)


# ---- hand-assembled pickle programs ------------------------------------------------------------

def _str(s: str) -> bytes:
    b = s.encode()
    return pickle.BINUNICODE + len(b).to_bytes(4, "little") + b


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + pickle.STACK_GLOBAL


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + module.encode() + b"\n" + name.encode() + b"\n"


def _call(fn: bytes, *args: bytes) -> bytes:
    return fn + pickle.MARK + b"".join(args) + pickle.TUPLE + pickle.REDUCE


def _program(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


def _touch(marker: Path) -> str:
    return f"touch {shlex.quote(str(marker))}"


def _dotted_name_program(marker: Path, opcode: str) -> bytes:
    """``os.system`` reached as a dotted name under a DCP module (DCP's filesystem module imports os)."""
    ref = (_stack_global if opcode == "STACK_GLOBAL" else _global)("torch.distributed.checkpoint.filesystem",
                                                                   "os.system")
    return _program(_call(ref, _str(_touch(marker))))


def _getattr_program(marker: Path) -> bytes:
    """``getattr(getattr(getattr(_get_layout, '__globals__'), 'get')('os'), 'system')(cmd)``:
    only exact (module, name) pairs that an allow-list once admitted."""
    g = _global("builtins", "getattr")
    module_globals = _call(g, _global("torch.serialization", "_get_layout"), _str("__globals__"))
    os_module = _call(_call(g, module_globals, _str("get")), _str("os"))
    return _program(_call(_call(g, os_module, _str("system")), _str(_touch(marker))))


class _RunsCode:
    """Pickles to a call of os.system: the payload a bytes entry would smuggle."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _load(loader: str, folder: Path):
    model, opt = _model()
    if loader == "load_checkpoint":
        return ck.load_checkpoint(folder, model, opt, model.rng)
    return ck.load_model_only(folder, model)


LOADERS = ["load_checkpoint", "load_model_only"]


# ---- 1. loading runs no code -------------------------------------------------------------------

@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("opcode", ["STACK_GLOBAL", "GLOBAL"])
def test_dotted_global_under_a_dcp_module_is_refused(tmp_path, tiny, loader, opcode):
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(_dotted_name_program(marker, opcode))
    _reseal(folder)
    with pytest.raises(pickle.UnpicklingError, match=r"torch\.distributed\.checkpoint\.filesystem\.os\.system.*"
                                                     r"not allowed"):
        _load(loader, folder)
    assert not marker.exists(), "loading the metadata ran os.system"


@pytest.mark.parametrize("loader", LOADERS)
def test_getattr_chain_from_allowed_names_is_refused(tmp_path, tiny, loader):
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(_getattr_program(marker))
    _reseal(folder)
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.getattr.*not allowed"):
        _load(loader, folder)
    assert not marker.exists(), "loading the metadata ran os.system through getattr"


@pytest.mark.parametrize("loader", LOADERS)
def test_tensor_entry_retyped_as_bytes_is_refused(tmp_path, tiny, loader):
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    marker = tmp_path / "pwned"
    payload = folder / "__9_0.distcp"
    torch.save(_RunsCode(_touch(marker)), payload)
    key = "optim_step" if loader == "load_checkpoint" else "model.ln_f.weight"

    def retype(md):
        assert key in md.state_dict_metadata, sorted(md.state_dict_metadata)
        md.state_dict_metadata[key] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(key)] = _StorageInfo(payload.name, 0, payload.stat().st_size)

    _rewrite_metadata(folder, retype)
    with pytest.raises(ValueError, match=rf"'{key}'.*bytes"):
        _load(loader, folder)
    assert not marker.exists(), "a bytes entry was unpickled with code execution"


@pytest.mark.parametrize("loader", LOADERS)
@pytest.mark.parametrize("where", ["parent", "absolute"])
def test_storage_paths_are_confined_to_the_checkpoint_folder(tmp_path, tiny, loader, where):
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    data = next(folder.glob("*.distcp"))
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(data.read_bytes())  # valid tensors, but not the checkpoint's own file
    rel = "../../outside.distcp" if where == "parent" else str(outside)

    def redirect(md):
        for info in md.storage_data.values():
            info.relative_path = rel

    _rewrite_metadata(folder, redirect)
    with pytest.raises(ValueError, match=r"outside the checkpoint folder"):
        _load(loader, folder)


def test_metadata_cannot_set_attributes_of_a_class(tmp_path, tiny):
    """A BUILD on an allowed class object (instead of an instance) would rewrite that class for the
    whole process; the unpickler refuses it."""
    from torch.distributed.checkpoint.metadata import Metadata
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    state = (pickle.NONE + pickle.EMPTY_DICT + _str("__repr__") + _stack_global("torch", "Size") +
             pickle.SETITEM + pickle.TUPLE2)
    md_class = _stack_global("torch.distributed.checkpoint.metadata", "Metadata")
    (folder / ".metadata").write_bytes(_program(md_class + state + pickle.BUILD))
    _reseal(folder)
    before = Metadata.__repr__
    with pytest.raises(pickle.UnpicklingError, match="class"):
        ck.load_model_only(folder, tiny[0])
    assert Metadata.__repr__ is before


def test_a_genuine_checkpoint_round_trips(tmp_path):
    model, opt = _model()
    folder = _save(tmp_path / "ckpt", 3, model_opt=(model, opt))
    other, other_opt = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    extra = ck.load_checkpoint(folder, other, other_opt, other.rng)
    assert extra["step"] == 3 and extra["tp"] == 1
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name
    p = next(model.parameters())
    assert torch.equal(opt.state[p]["exp_avg"], other_opt.state[next(other.parameters())]["exp_avg"])


# ---- 2. keep-N keeps the newest state ----------------------------------------------------------

def test_keep_never_deletes_the_checkpoint_just_written(tmp_path, tiny):
    root = tmp_path / "ckpt"
    _save(root, 900, model_opt=tiny)
    _save(root, 1000, model_opt=tiny)  # an earlier run in the same dir
    written = _save(root, 5, keep=2, model_opt=tiny)
    assert written.is_dir() and (written / MARKER).is_file(), "the checkpoint just written was deleted"
    assert (root / "latest").read_text().strip() == written.name
    assert ck.latest_checkpoint(root) == written, "resume must pick what `latest` names"
    assert sorted(p.name for p in ck.complete_checkpoints(root)) == ["step_00000005", "step_00001000"]


def test_steps_from_10_to_the_8_order_as_numbers(tmp_path, tiny):
    root = tmp_path / "ckpt"
    for step in (99_999_999, 100_000_000, 100_000_001):
        _save(root, step, keep=2, model_opt=tiny)
    assert [p.name for p in ck.complete_checkpoints(root)] == ["step_100000000", "step_100000001"]
    assert ck.latest_checkpoint(root).name == "step_100000001"


# ---- 3. complete or skipped --------------------------------------------------------------------

def _truncate_data(folder: Path) -> None:
    data = next(folder.glob("*.distcp"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)


DAMAGE = {"truncated data file": _truncate_data,
          "empty extra.json": lambda folder: (folder / "extra.json").write_text(""),
          "missing marker": lambda folder: (folder / MARKER).unlink()}


def test_the_marker_lists_every_file_with_its_size(tmp_path, tiny):
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    marker = json.loads((folder / MARKER).read_text())
    on_disk = {p.name: p.stat().st_size for p in folder.iterdir() if p.name != MARKER}
    assert {k: marker[k] for k in ("step", "files")} == {"step": 3, "files": on_disk}
    from seqpar.checkpoint.integrity import file_checksum
    assert marker["crc32"] == {name: file_checksum(folder / name) for name in on_disk}
    assert {".metadata", "extra.json", "config.yaml", "rng_rank0.pt"} <= set(on_disk)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_broken_newest_checkpoint_is_skipped_with_a_line(tmp_path, tiny, damage):
    root = tmp_path / "ckpt"
    good = _save(root, 10, model_opt=tiny)
    broken = _save(root, 20, model_opt=tiny)
    DAMAGE[damage](broken)
    said: list[str] = []
    assert ck.latest_checkpoint(root, log=said.append) == good
    assert len(said) == 1 and broken.name in said[0] and "skipped" in said[0], said
    assert ck.complete_checkpoints(root) == [good]
    with pytest.raises(ValueError, match=rf"{broken.name}.*incomplete"):
        ck.load_model_only(broken, tiny[0])


def test_every_file_and_the_folder_are_fsynced_before_the_marker(tmp_path, tiny, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    folder = _save(tmp_path / "ckpt", 3, model_opt=tiny)
    tmp = str(folder) + ".tmp"
    marker_at = synced.index(os.path.join(tmp, MARKER))
    before = set(synced[:marker_at])
    missing = [p.name for p in folder.iterdir() if p.name != MARKER and os.path.join(tmp, p.name) not in before]
    assert not missing, f"not fsynced before the marker: {missing}"
    assert tmp in synced[marker_at:], "the folder is fsynced after the marker is written"
    assert str(folder.parent) in synced, "the rename into place is made durable"


def test_resaving_a_step_never_leaves_it_missing(tmp_path, tiny, monkeypatch):
    """Re-saving step N: at every rename and delete a complete step N exists (in place or set aside),
    and a crash between setting the old one aside and renaming the new one in is healed at start-up."""
    root = tmp_path / "ckpt"
    first = _save(root, 4, model_opt=tiny)

    def a_complete_step_4_exists(op):
        held = [p for p in root.glob("step_00000004*") if not p.name.endswith(".tmp")
                and (p / ".metadata").is_file() and (p / "extra.json").is_file()]
        assert held, f"after {op} no complete step 4 exists: {sorted(p.name for p in root.iterdir())}"

    real_replace, real_rmtree = os.replace, ck.shutil.rmtree

    def checked_replace(a, b):
        real_replace(a, b)
        a_complete_step_4_exists(f"replace {Path(a).name} -> {Path(b).name}")

    def checked_rmtree(path, *a, **kw):
        real_rmtree(path, *a, **kw)
        a_complete_step_4_exists(f"rmtree {Path(path).name}")

    monkeypatch.setattr(os, "replace", checked_replace)
    monkeypatch.setattr(ck.shutil, "rmtree", checked_rmtree)
    _save(root, 4, model_opt=tiny)
    monkeypatch.undo()

    def crash_on_rename_in(a, b):  # the old folder is set aside, then the job dies
        if Path(a).name == "step_00000004.tmp":
            raise KeyboardInterrupt("killed")
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", crash_on_rename_in)
    with pytest.raises(KeyboardInterrupt):
        _save(root, 4, model_opt=tiny)
    monkeypatch.undo()
    handle = ck.open_checkpoint_dir(root, True)
    handle.close()
    assert ck.latest_checkpoint(root) == first and ck.checkpoint_problem(first) is None
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == ["step_00000004"]


def test_stale_tmp_folders_are_removed_at_start_up(tmp_path):
    root = tmp_path / "ckpt"
    stale = root / "step_00000007.tmp"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"half")
    handle = ck.open_checkpoint_dir(root, True)
    try:
        assert not stale.exists()
    finally:
        handle.close()


# ---- 4. one job per checkpoint dir -------------------------------------------------------------

_HOLDER = """
import sys, time
from seqpar.checkpoint import open_checkpoint_dir
handle = open_checkpoint_dir(sys.argv[1], True)
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_job_on_the_same_dir_fails_naming_the_holder(tmp_path):
    root = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RuntimeError, match=rf"{socket.gethostname()}.*pid {holder.pid}"):
            ck.open_checkpoint_dir(root, True)
    finally:
        holder.kill()
        holder.wait()
    handle = ck.open_checkpoint_dir(root, True)  # the holder is gone: the lock is free again
    try:
        with pytest.raises(RuntimeError, match=rf"pid {os.getpid()}"):
            ck.open_checkpoint_dir(root, True)
    finally:
        handle.close()
    ck.open_checkpoint_dir(root, True).close()


def _open_twice_on_ranks(rank, world, root):
    """Claim the dir (rank 0 locks it), then claim it again as a second job would."""
    first = ck.open_checkpoint_dir(root, rank == 0)
    try:
        ck.open_checkpoint_dir(root, rank == 0).close()
        return None, os.getpid()
    except RuntimeError as e:
        return str(e), os.getpid()
    finally:
        first.close()


def test_every_rank_fails_when_the_dir_is_held(spawn, tmp_path):
    (m0, holder), (m1, _) = spawn(_open_twice_on_ranks, 2, str(tmp_path / "ckpt"))
    assert m0 and m1 and f"pid {holder}," in m0 and f"pid {holder}," in m1, (m0, m1)
    ck.open_checkpoint_dir(tmp_path / "ckpt", True).close()  # released by the job that held it


def test_only_the_first_rank_takes_the_lock(tmp_path):
    root = tmp_path / "ckpt"
    held = ck.open_checkpoint_dir(root, True)
    try:
        ck.open_checkpoint_dir(root, False).close()  # not rank 0: neither takes nor checks the lock
    finally:
        held.close()


def test_the_trainer_holds_its_checkpoint_dir_until_closed(tmp_path):
    import numpy as np

    from seqpar.config import load_run_config
    from seqpar.distributed.mesh import ParallelMesh
    from seqpar.train import Trainer
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, size=3000).astype(np.uint16))
    root = tmp_path / "ckpt"
    overrides = [f"{k}={v}" for k, v in {
        "model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 2, "model.layers": 1,
        "train.steps": 2, "train.micro_batch": 2, "train.global_batch": 2, "train.eval_interval": 0,
        "data.source": tmp_path / "tokens.npy", "checkpoint.dir": root, "out_dir": tmp_path / "out"}.items()]
    (root / "step_00000002.tmp").mkdir(parents=True)  # a save that crashed in an earlier job
    trainer = Trainer(load_run_config(None, overrides), mesh=ParallelMesh.single())
    try:
        assert not (root / "step_00000002.tmp").exists()
        with pytest.raises(RuntimeError, match=rf"in use by another job \(host .*, pid {os.getpid()},"):
            Trainer(load_run_config(None, overrides), mesh=ParallelMesh.single())
    finally:
        trainer.close()
    ck.open_checkpoint_dir(root, True).close()
