"""Context parallelism in the Trainer: cp=2 x tp=2, cp=2 x dp=2 (ddp, and FSDP2 over dp x cp) and
pp=2 x cp=2 train like one process, the token count behind tokens/s is the global batch's, checkpoints resume
across cp."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from seqpar.config import load_run_config
from seqpar.distributed.mesh import ParallelMesh, init_parallel
from seqpar.train import Trainer
from seqpar.train.resolve import resolve_run

from run_helpers import TINY_MODEL, cli_here, run_overrides


# no dropout (cp refuses attention dropout) so every layout's losses equal one process's
RUN = {**TINY_MODEL, "model.heads": 2, "model.layers": 2, "model.dropout": 0.0, "model.attention_dropout": 0.0,
       "model.recompute": "selective", "train.steps": 4, "train.micro_batch": 2, "train.global_batch": 4,
       "train.lr": 3e-3, "train.warmup_steps": 1, "train.eval_interval": 0, "train.seed": 5,
       "train.log_interval": 1, "checkpoint.interval": 0}


def _config(tmp, out: str, **extra):
    """The run writing to ``tmp / out`` with its own checkpoint dir, on ``tmp / "tokens.npy"``."""
    return load_run_config(None, run_overrides(tmp, RUN, tokens=tmp / "tokens.npy", out=out, ckpt=f"{out}/ckpt",
                                               **extra))


def _save_at_2(tmp, out: str, mesh, **extra) -> None:
    trainer = Trainer(_config(tmp, out, **extra), mesh=mesh)
    try:
        trainer.train_step(0)
        trainer.train_step(1)
        trainer.checkpoints.save(2)
    finally:
        trainer.close()


def _fit(tmp, out: str, mesh, **extra) -> dict:
    """This rank's losses, global grad norms and counted tokens/FLOPs of ``Trainer.fit``."""
    trainer = Trainer(_config(tmp, out, **extra), mesh=mesh)
    counted = (trainer.throughput.tokens_per_step, trainer.throughput.flops_per_step)
    norms, step = [], trainer.train_step

    def recorded(i):  # the norm this rank computed (metrics.jsonl has global rank 0's only)
        m = step(i)
        norms.append(m.grad_norm)
        return m
    trainer.train_step = recorded
    history = trainer.fit()
    return {"losses": history["losses"], "counted": counted, "norms": norms}


def _single(rank, world, tmp, phase):
    mesh = ParallelMesh.single()
    if phase == "before":
        _save_at_2(tmp, "one-saved", mesh)
        return _fit(tmp, "one", mesh)
    return _fit(tmp, "cp-saved", mesh, **{"checkpoint.resume": "auto"})  # the cp=2 x tp=2 checkpoint


def _layouts(rank, world, tmp):
    out = {}
    for name, tp, cp, comm, dpm in (("tp2cp2", 2, 2, "allgather", "ddp"), ("dp2cp2", 1, 2, "ring", "ddp"),
                                    ("fsdp-dp2cp2", 1, 2, "allgather", "fsdp"), ("fsdp-tp2cp2", 2, 2, "ring", "fsdp")):
        mesh = init_parallel(tp=tp, cp=cp)
        out[name] = _fit(tmp, name, mesh, **{"parallel.tp": tp, "parallel.cp": cp, "parallel.cp_comm": comm,
                                             "parallel.data_parallel": dpm})
    mesh = init_parallel(tp=1, cp=2, pp=2)  # two pipeline stages of cp=2
    out["pp2cp2"] = _fit(tmp, "pp2cp2", mesh, **{"parallel.pp": 2, "parallel.cp": 2})
    mesh = init_parallel(tp=2, cp=2)
    cp_run = {"parallel.tp": 2, "parallel.cp": 2}
    # the one-process checkpoint, resumed at cp=2 x tp=2 (the same dense pieces)
    out["resumed"] = _fit(tmp, "one-saved", mesh, **cp_run, **{"checkpoint.resume": "auto"})
    _save_at_2(tmp, "cp-saved", mesh, **cp_run)
    out["rng_kept"] = _rng_after_resume_at_dp2(tmp)
    return out


def _rng_after_resume_at_dp2(tmp) -> bool:
    """The cp=2 x tp=2 checkpoint resumed at dp=2 x tp=2 (the same world size): its per-rank RNG
    states belong to other ranks' roles, so the fresh streams must be kept."""
    trainer = Trainer(_config(tmp, "cp-saved", **{"parallel.tp": 2, "checkpoint.resume": "auto"}),
                      mesh=init_parallel(tp=2))
    try:
        fresh = trainer.engine.streams[0].get_state()
        trainer.checkpoints.resume()
        after = trainer.engine.streams[0].get_state()
    finally:
        trainer.close()
    return all(torch.equal(fresh[k], after[k]) for k in fresh if torch.is_tensor(fresh[k]))


def test_context_parallel_trainer_equals_one_process(spawn, tmp_path):
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, size=4000).astype(np.uint16))
    one = spawn(_single, 1, tmp_path, "before")[0]
    ranks = spawn(_layouts, 4, tmp_path)
    back = spawn(_single, 1, tmp_path, "after")[0]
    ref = one["losses"]
    assert len(ref) == 4
    assert len(one["norms"]) == 4
    for rank, r in enumerate(ranks):  # every rank, not only the one that writes metrics.jsonl
        for name in ("tp2cp2", "dp2cp2", "fsdp-dp2cp2", "fsdp-tp2cp2", "pp2cp2"):  # FSDP2 shards over dp x cp
            assert np.allclose(r[name]["losses"], ref, atol=1e-5, rtol=0), (rank, name, r[name]["losses"], ref)
            # one global norm, the same on every rank, clipped alike
            assert np.allclose(r[name]["norms"], one["norms"], rtol=1e-5), (rank, name, r[name]["norms"])
            # tokens/s and MFU count the global batch's tokens and FLOPs once, not once per CP rank
            assert r[name]["counted"] == one["counted"] and one["counted"][0] == 4 * 16
        assert np.allclose(r["resumed"]["losses"], ref[2:], atol=1e-5, rtol=0), (rank, r["resumed"], ref)
        assert np.allclose(r["resumed"]["norms"], one["norms"][2:], rtol=1e-5), (rank, r["resumed"])
        assert r["rng_kept"], rank
    assert np.allclose(back["losses"], ref[2:], atol=1e-5, rtol=0), (back, ref)


def test_resolve_refuses_bad_cp_layouts():
    def resolve(world, **kw):
        return resolve_run(load_run_config(None, [f"{k}={v}" for k, v in kw.items()]), world)
    with pytest.raises(ValueError, match=r"pp=1 x dp=1 x cp=2 x tp=2 = 4, world size = 8"):
        resolve(8, **{"parallel.cp": 2, "parallel.tp": 2, "parallel.dp": 1, "model.attention_dropout": 0.0})
    with pytest.raises(ValueError, match=r"model.seq_len / parallel.cp: sequence length 1000 is not divisible "
                                         r"by 2 x cp = 16"):
        resolve(8, **{"parallel.cp": 8, "model.seq_len": 1000})
    with pytest.raises(ValueError, match=r"attention_dropout=0.1 with parallel.cp=2"):
        resolve(2, **{"parallel.cp": 2})
    with pytest.raises(ValueError, match=r"parallel.cp_comm: expected one of \['allgather', 'ring'\], got 'p2p'"):
        resolve(2, **{"parallel.cp": 2, "parallel.cp_comm": "p2p"})
    with pytest.raises(ValueError, match=r"parallel.cp_comm=ring with parallel.pp=2 is not supported yet"):
        resolve(4, **{"parallel.cp": 2, "parallel.pp": 2, "parallel.cp_comm": "ring", "model.attention_dropout": 0.0,
                      "model.layers": 2})
    run = resolve(8, **{"parallel.cp": 2, "parallel.tp": 2, "model.attention_dropout": 0.0})
    assert (run.dp, run.dp_mode) == (2, "ddp")


ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp, nproc: int, *overrides: str, capsys=None) -> tuple[list[float], list[float]]:
    """``seqpar train configs/tiny-cpu.yaml --nproc-per-node N`` for 3 steps: (printed losses, logged
    ones). With ``capsys``: one process, through the command's own function in this one."""
    out = tmp / f"nproc{nproc}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    args = ["train", str(ROOT / "configs/tiny-cpu.yaml"), *overrides, "train.steps=3", "train.log_interval=1",
            "train.eval_interval=0", "checkpoint.interval=0", f"out_dir={out}", f"checkpoint.dir={out / 'ckpt'}"]
    if capsys is not None:
        run = cli_here(args, capsys)
    else:
        run = subprocess.run([sys.executable, "-m", "seqpar.cli", *args[:2], "--nproc-per-node", str(nproc), *args[2:]],
                             cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    printed = [float(x) for x in re.findall(r"^step +\d+/3 .*?\| loss ([0-9.]+) \|", run.stdout, re.M)]
    logged = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return printed, logged


def test_the_issue_command_trains_the_one_process_losses(tmp_path, capsys):
    """Done means: `seqpar train configs/tiny-cpu.yaml --nproc-per-node 4 parallel.cp=2 parallel.tp=2`
    trains the losses of `--nproc-per-node 1` (same seed and data) within 1e-4."""
    one = _launch(tmp_path, 1, "parallel.tp=1", capsys=capsys)
    cp = _launch(tmp_path, 4, "parallel.cp=2", "parallel.tp=2")
    assert len(one[0]) == len(cp[0]) == len(one[1]) == len(cp[1]) == 3, (one, cp)
    assert np.allclose(cp[1], one[1], atol=1e-4, rtol=0), (cp[1], one[1])
    assert np.allclose(cp[0], one[0], atol=1e-4 + 1e-4, rtol=0), (cp[0], one[0])  # printed to 4 decimals
