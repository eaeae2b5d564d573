"""User-input errors through the command line: one line naming the offending value, exit code 2,
no traceback, for every entry point. Commands that start ranks run in a subprocess (several bad
inputs per start); the others through ``seqpar.cli.main`` in this process, the console script's
own function (the installed script itself: tests/test_installed_wheel.py)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed
from run_helpers import cli_here as _cli

from seqpar.config.errors import UserError, is_user_error

TINY = ["model.vocab_size=128", "model.seq_len=32", "model.hidden=32", "model.heads=4", "model.layers=2",
        "train.micro_batch=4", "train.eval_interval=0", "checkpoint.resume=never", "train.steps=2"]


def _tokens(tmp: Path, bad_id: int | None = None) -> str:
    ids = np.random.default_rng(0).integers(0, 128, size=4000).astype(np.uint16)
    if bad_id is not None:
        ids[500] = bad_id
    path = tmp / ("bad.npy" if bad_id is not None else "tokens.npy")
    np.save(path, ids)
    return str(path)


def _run(args: list[str], cwd: Path, timeout=240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]
    for needle in needles:
        assert needle in proc.stderr, proc.stderr[-3000:]


def test_user_errors_are_decided_by_their_type():
    assert is_user_error(UserError("x"))
    try:
        int("nope")  # raised here, outside seqpar: internal
    except ValueError as e:
        assert not is_user_error(e)
    try:
        np.zeros(3).reshape(7)  # raised inside numpy: internal
    except ValueError as e:
        assert not is_user_error(e)
    from seqpar.config import ConfigError, load_run_config
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["train.stepz=3"])
    assert is_user_error(info.value)
    # a ValueError raised inside seqpar that is not about the input is a bug (before: any ValueError
    # whose innermost frame was seqpar's counted as bad input)
    from seqpar.recompute import checkpoint_runs
    with pytest.raises(ValueError) as info:
        checkpoint_runs(2, "uniform", 0)
    assert not is_user_error(info.value)
    with pytest.raises(OSError) as info:
        open(Path(__file__).parent / "no-such-file")  # an OSError is internal unless wrapped at its boundary
    assert not is_user_error(info.value)


# run through the seqpar command with one of seqpar's own functions broken: a ValueError raised
# inside seqpar (an internal invariant, not the input) from the point where the command calls it
BROKEN = """
import sys
from seqpar.recompute import checkpoint_runs
def broken(*args, **kwargs):
    return checkpoint_runs(2, "uniform", 0)  # ValueError("recompute_num_layers must be >= 1, got 0")
import {module} as target
target.{name} = broken
from seqpar.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_internal_error_keeps_its_traceback(tmp_path):
    """`seqpar memory` and `seqpar train` (one process) meeting a ValueError that is a bug: its
    traceback, exit 1 -- not a one-line user error with exit 2."""
    cases = [("seqpar.tools.memory_cli", "state_table", ["memory", "tiny-cpu", "--dp", "2"]),
             ("seqpar.train.trainer", "check_memory", ["train", *TINY, f"checkpoint.dir={tmp_path / 'c'}",
                                                        f"out_dir={tmp_path / 'o'}"])]
    for module, name, args in cases:
        script = BROKEN.format(module=module, name=name)
        p = _run([sys.executable, "-c", script, *args], tmp_path)
        assert p.returncode == 1, (args[0], p.returncode, p.stderr[-3000:])
        assert "Traceback (most recent call last)" in p.stderr, p.stderr[-3000:]
        assert "ValueError: recompute_num_layers must be >= 1, got 0" in p.stderr, p.stderr[-3000:]
        assert f"seqpar {args[0]}: recompute_num_layers" not in p.stderr, p.stderr[-3000:]


def test_memory_and_plan_refusals_go_through_the_one_error_path(capsys):
    """`seqpar memory` and `seqpar plan` raise UserError (before: they printed their own line and
    returned 2, outside the entry point's error path); the seqpar command prints it as one line."""
    from seqpar import cli
    from seqpar.plan import cli as plan_cli
    from seqpar.tools import memory_cli
    with pytest.raises(UserError, match="--micro-batch must be a positive integer, got 0"):
        memory_cli.main(["tiny-cpu", "--micro-batch", "0"])
    with pytest.raises(UserError, match="--gpus=0"):
        plan_cli.main(["tiny-cpu", "--gpus", "0", "--gpu", "a100-80gb"])
    capsys.readouterr()
    assert cli.main(["memory", "tiny-cpu", "--micro-batch", "0"]) == 2
    assert cli.main(["memory", "tiny-cpu", "--tp", "3"]) == 2  # a layout the model cannot split
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "seqpar memory: --micro-batch must be a positive integer, got 0", err
    assert err[1].startswith("seqpar memory: ") and "tensor-parallel size t=3" in err[1], err
    assert len(err) == 2, err


def test_train_single_process_and_launcher_print_one_line(tmp_path, capsys):
    seqpar = [sys.executable, "-m", "seqpar.cli"]
    common = TINY + [f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'out'}"]
    bad = _tokens(tmp_path, bad_id=60000)
    p = _cli(["train", f"data.source={bad}"] + common, capsys)  # one process: the command's function here
    _assert_one_line(p, "id 60000", "model.vocab_size")
    p = _cli(["train", f"data.source={_tokens(tmp_path)}", "train.global_batch=7"] + common, capsys)
    _assert_one_line(p, "train.global_batch (7)")
    assert not torch.distributed.is_initialized(), "a refused one-process run leaves no process group"
    p = _run(seqpar + ["train", "--nproc-per-node", "2", f"data.source={bad}"] + common, tmp_path)
    # printed once, naming the ranks that reported it before the launcher stopped the others
    _assert_one_line(p, "id 60000")
    lines = [ln for ln in p.stderr.splitlines() if "id 60000" in ln]
    assert len(lines) == 1 and re.match(r"seqpar train: ranks? [01](, 1)?: ", lines[0]), p.stderr[-3000:]
    assert p.stderr.count("id 60000") == 1, p.stderr


def test_plain_torchrun_ranks_print_their_line_and_exit_2(tmp_path):
    """torchrun itself still ends with its ChildFailedError summary (its own traceback); each rank's
    line is one line, and the summary quotes it instead of an empty error file."""
    bad = _tokens(tmp_path, bad_id=60000)
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
              "seqpar.train", f"data.source={bad}", f"checkpoint.dir={tmp_path / 'c'}",
              f"out_dir={tmp_path / 'o'}"] + TINY, tmp_path)
    assert p.returncode == 1, p.stderr[-3000:]  # torchrun's own status for failed workers
    # torchrun's summary: each worker's exit code, and the worker's one line as its "traceback"
    codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*: (-?\d+)", p.stderr))
    assert codes == {"0": "2", "1": "2"}, p.stderr[-3000:]
    for rank in (0, 1):
        assert f"seqpar train: rank {rank}: token file" in p.stderr, p.stderr[-3000:]
        assert f"traceback : seqpar train: rank {rank}: token file" in p.stderr, p.stderr[-3000:]
    # the only traceback is torchrun's ChildFailedError, raised in torch's launcher: no worker printed one
    out = p.stdout + p.stderr
    assert out.count("Traceback (most recent call last)") == 1, out[-3000:]
    launcher = out[out.index("Traceback (most recent call last)"):out.index("ChildFailedError:")]
    assert "seqpar" not in launcher.replace("seqpar.train FAILED", ""), launcher


def test_generate_export_import_memory_plan(tmp_path, capsys):
    p = _cli(["generate", str(tmp_path / "nowhere")], capsys)
    _assert_one_line(p, "nowhere")
    p = _cli(["generate", str(tmp_path), "--tokens", "-3"], capsys)
    _assert_one_line(p, "--tokens", "-3")
    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"garbage")
    (folder / "config.yaml").write_text("model:\n  vocab_size: 128\n")
    p = _cli(["generate", str(folder)], capsys)
    _assert_one_line(p, "model.safetensors")
    (tmp_path / "afile").write_text("x")
    p = _cli(["export", str(tmp_path / "nowhere"), str(tmp_path / "afile")], capsys)
    _assert_one_line(p, "afile")
    p = _cli(["export", str(tmp_path / "nowhere"), str(folder)], capsys)
    _assert_one_line(p, "--force")
    p = _cli(["import", str(folder), str(tmp_path / "imp")], capsys)
    _assert_one_line(p, "config.json")
    # a layout the model cannot split: refused naming t and each indivisible size, no figures printed
    p = _cli(["memory", "tiny-cpu", "--tp", "3"], capsys)
    _assert_one_line(p, "tiny-cpu.yaml", "tensor-parallel size t=3", "heads (4)", "hidden (128)")
    assert "per layer" not in p.stdout, p.stdout
    p = _cli(["plan", "tiny-cpu", "--gpus", "3", "--gpus-per-node", "3", "--gpu", "a100-80gb",
              "--global-batch", "3", "--layout", "tp=3"], capsys)
    _assert_one_line(p, "layout t=3", "tensor-parallel size t=3", "heads (4)")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_checkpoints_that_are_unsafe_outside_or_in_use_are_one_line(tmp_path, capsys, monkeypatch):
    """A malicious metadata pickle, a shard symlinked outside its folder and a checkpoint dir held by
    another job: each refused in one line naming it, exit 2, through `train` and `generate`."""
    import pickle
    import shutil

    from seqpar.checkpoint.files import open_checkpoint_dir
    seqpar = [sys.executable, "-m", "seqpar.cli"]
    ckpt = tmp_path / "ckpt"
    common = TINY + [f"data.source={_tokens(tmp_path)}", f"checkpoint.dir={ckpt}", f"out_dir={tmp_path / 'out'}",
                     "checkpoint.interval=2"]
    p = _cli(["train"] + common, capsys)
    assert p.returncode == 0, p.stderr[-3000:]
    step = ckpt / "step_00000002"
    with open_checkpoint_dir(ckpt, is_first=True):  # another job holds the dir
        p = _run(seqpar + ["train"] + common + ["train.steps=4", "checkpoint.resume=auto"], tmp_path)
    _assert_one_line(p, "in use by another job", str(ckpt))
    shard = next(step.glob("*.distcp"))
    outside = tmp_path / "elsewhere.distcp"
    shutil.move(shard, outside)
    shard.symlink_to(outside)
    monkeypatch.chdir(tmp_path)  # where the pickle would write if it ran
    p = _cli(["generate", str(step), "--tokens", "2"], capsys)
    _assert_one_line(p, "outside the checkpoint folder", shard.name)
    shard.unlink()
    shutil.move(outside, shard)
    (step / ".metadata").write_bytes(pickle.dumps(_Evil()))
    p = _cli(["generate", str(step), "--tokens", "2"], capsys)
    _assert_one_line(p, ".metadata")
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.parametrize("nproc", [1, 2])
def test_launcher_prints_each_rank_refusal_with_one_rank_as_with_two(tmp_path, nproc, capsys):
    """`seqpar train --nproc-per-node N`: a rank's user error is one line and exit 2 for N = 1 too
    (before the fix one rank's line had no "rank R:" prefix, so the launcher printed only "rank 0
    failed (exit code 2)" and exited 1). Refusals: data missing or bad, a world the layout does
    not fit, a checkpoint dir another job holds, a checkpoint of another model."""
    from seqpar.checkpoint.files import open_checkpoint_dir
    seqpar = [sys.executable, "-m", "seqpar.cli"]
    ckpt = tmp_path / "ckpt"
    common = TINY + [f"checkpoint.dir={ckpt}", f"out_dir={tmp_path / 'out'}", f"parallel.tp={nproc}"]
    good = f"data.source={_tokens(tmp_path)}"
    p = _cli(["train", good, "checkpoint.interval=2"] + common[:-1], capsys)  # one process, in this one
    assert p.returncode == 0, p.stderr[-3000:]
    launch = seqpar + ["train", "--nproc-per-node", str(nproc)]
    cases = [([good, "model.layers=3", "checkpoint.resume=auto"], "holds another model than this run: "
              "model.layers: 2 -> 3")]
    if nproc == 1:  # the same lines at 2 ranks: test_train_single_process_and_launcher_print_one_line
        cases += [([f"data.source={tmp_path / 'nowhere'}", "model.vocab_size=512"],  # a text folder's vocabulary
                   f"corpus source '{tmp_path / 'nowhere'}' does not exist"),
                  ([f"data.source={_tokens(tmp_path, bad_id=60000)}"], "id 60000"),
                  ([good, "parallel.tp=2"], "world size 1 is not divisible by tp=2")]
    for args, needle in cases:
        p = _run(launch + common + args, tmp_path)
        _assert_launcher_line(p, needle, nproc)
    with open_checkpoint_dir(ckpt, is_first=True):  # another job holds the dir
        p = _run(launch + common + [good, "checkpoint.resume=auto"], tmp_path)
    _assert_launcher_line(p, f"checkpoint dir {ckpt} is in use by another job", nproc)


def _assert_launcher_line(proc: subprocess.CompletedProcess, needle: str, nproc: int) -> None:
    _assert_one_line(proc, needle)
    lines = [ln for ln in proc.stderr.splitlines() if needle in ln]
    who = "" if nproc == 1 else r"ranks? [01](, 1)?: "
    assert len(lines) == 1 and re.match(rf"seqpar train: {who}\S", lines[0]), proc.stderr[-3000:]
    assert "failed (exit code" not in proc.stderr, proc.stderr[-3000:]
