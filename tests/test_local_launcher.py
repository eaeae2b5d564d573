"""seqpar.distributed.local.run_local: N gloo ranks, results in rank order, the first error, a timeout."""
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

from seqpar.distributed.local import RankFailed, run_local
import seqpar


def _report(rank, world_size, tag):
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)  # a real collective over the file:// rendezvous
    return {"rank": rank, "world": world_size, "tag": tag, "dist_rank": dist.get_rank(),
            "dist_world": dist.get_world_size(), "sum": x.item(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _fail_on_one(rank, world_size):
    if rank == 1:
        raise ValueError("bad value 42 on purpose")
    dist.barrier()  # the others wait for rank 1, which never comes: they must be stopped, not waited for
    return rank


def _hang(rank, world_size, marker_dir):
    with open(os.path.join(marker_dir, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        time.sleep(3600)
    return rank


def _die(rank, world_size):
    if rank == 0:
        os._exit(3)
    return rank


def test_results_come_back_in_rank_order_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = run_local(_report, 3, "t", tmp_dir=tmp_path)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # the caller's setting is left as it was
    assert [r["rank"] for r in out] == [r["dist_rank"] for r in out] == [0, 1, 2]
    for r in out:
        assert (r["world"], r["dist_world"], r["tag"], r["sum"], r["threads"]) == (3, 3, "t", 6.0, 1)
        assert r["visible"] == "" and r["cuda"] is False  # GPUs hidden from every rank
    assert run_local(_report, 1, "one", threads=2, tmp_dir=tmp_path)[0]["threads"] == 2
    assert list(tmp_path.iterdir()) == []  # the rendezvous dir is removed


def _parent_and_gpus(rank, world_size):
    return os.getppid(), os.environ.get("CUDA_VISIBLE_DEVICES")


def test_gpus_true_shows_the_callers_gpus_to_ranks_spawned_fresh(tmp_path, monkeypatch):
    """The GPU checks put two gloo ranks on one GPU: with ``gpus=True`` the ranks see the caller's
    CUDA_VISIBLE_DEVICES and are the caller's own children (spawned: no CUDA state inherited from
    the forkserver); by default they are forked by the server, GPUs hidden."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert run_local(_parent_and_gpus, 1, tmp_dir=tmp_path, gpus=True) == [(os.getpid(), "0")]
    parent, visible = run_local(_parent_and_gpus, 1, tmp_dir=tmp_path)[0]
    assert parent != os.getpid() and visible == ""


def test_a_failing_rank_is_reraised_with_its_rank_and_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 3 failed: ValueError: bad value 42 on purpose") as info:
        run_local(_fail_on_one, 3, collective_timeout=300, tmp_dir=tmp_path)
    assert info.value.rank == 1
    assert "_fail_on_one" in info.value.traceback and 'raise ValueError("bad value 42' in str(info.value)
    assert time.monotonic() - start < 120  # ranks 0 and 2 were stopped, not left to the 300 s collective timeout
    assert multiprocessing.active_children() == []


def test_a_hung_rank_is_killed_by_the_timeout(tmp_path):
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[0.*\] of 2 still running _hang after 5 s; killed"):
        run_local(_hang, 2, str(tmp_path), timeout=5, tmp_dir=tmp_path)
    assert multiprocessing.active_children() == []
    for marker in tmp_path.glob("rank*.pid"):  # every rank that got as far as fn is gone
        with pytest.raises(ProcessLookupError):
            os.kill(int(marker.read_text()), 0)


def test_a_rank_that_dies_without_an_exception_fails_the_call(tmp_path):
    with pytest.raises(RankFailed, match=r"rank 0 of 2 failed: process exited with code 3"):
        run_local(_die, 2, tmp_dir=tmp_path)


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(TypeError, match="must be picklable"):
        run_local(lambda rank, world: rank, 2)
    with pytest.raises(ValueError, match="world_size >= 1 and threads >= 1, got 0 and 1"):
        run_local(_report, 0, "x")


def test_a_rank_that_cannot_start_reports_the_start_error(tmp_path):
    """Starting from a main module without the __main__ guard fails in multiprocessing itself;
    that error, not a secondary one from stopping never-started ranks, reaches the caller."""
    import subprocess
    import sys
    script = tmp_path / "unguarded.py"
    script.write_text("from seqpar.distributed.local import run_local\n"
                      "def fn(rank, world):\n    return rank\n"
                      "print(run_local(fn, 2, timeout=60))\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "can only join a started process" not in out.stderr
    assert "bootstrapping phase" in out.stderr


def test_a_parallel_script_started_without_torchrun_says_how_to_start_it(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 2"):
        seqpar.init_parallel(tp=2)
    with pytest.raises(ValueError, match=r"torchrun --nproc-per-node 4"):
        seqpar.init_parallel(tp=2, pp=2)
    assert seqpar.init_parallel(tp=1).world_size == 1  # one process needs no launcher
