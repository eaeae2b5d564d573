"""A checkpoint written right after an evaluation is complete and resumes exactly, at every layout.

Under FSDP2 the root unit keeps its parameters gathered after a forward; a forward with no
backward (evaluation, sampling) used to leave the gathered copies registered, so a save right
after it wrote no AdamW moments for the root's parameters and the resume failed. Each layout here
trains 3 steps, evaluates, saves, then resumes to step 5 and must reproduce the uninterrupted run.
"""
from pathlib import Path

import pytest
import torch

from run_helpers import SHARDED_RUN, run_overrides

STEPS = 5
RUN = {**SHARDED_RUN, "model.layers": 2, "train.eval_interval": 3, "train.eval_batches": 2,
       "checkpoint.interval": 3, "checkpoint.resume": "auto"}
LAYOUTS = {  # 4 ranks each
    "fsdp tp=2 dp=2": {"parallel.tp": 2, "parallel.data_parallel": "fsdp"},
    "ddp tp=2 dp=2": {"parallel.tp": 2, "parallel.data_parallel": "ddp"},
    "pp=2 tp=2": {"parallel.tp": 2, "parallel.pp": 2},
    "cp=2 tp=2": {"parallel.tp": 2, "parallel.cp": 2},
}


def _fit(tmp: Path, layout: dict, steps: int, ckpt: str) -> dict:
    from seqpar.config import load_run_config
    from seqpar.train import train
    return train(load_run_config(None, run_overrides(tmp, {**RUN, **layout, "train.steps": steps}, ckpt=ckpt)))


def _runs(rank, world, tmp):
    tmp, out = Path(tmp), {}
    out["reference"] = _fit(tmp, LAYOUTS["ddp tp=2 dp=2"], STEPS, "ref")["losses"]
    for i, (name, layout) in enumerate(LAYOUTS.items()):
        first = _fit(tmp, layout, 3, f"ck{i}")
        second = _fit(tmp, layout, STEPS, f"ck{i}")  # resumes from the step-3 checkpoint, written after an eval
        out[name] = (first["eval"], second["steps"], second["losses"])
    return out


def test_checkpoints_written_after_an_eval_resume_at_every_layout(spawn, tmp_path):
    res = spawn(_runs, 4, str(tmp_path))
    ref = res[0]["reference"]
    for r in res:
        for name in LAYOUTS:
            evals, steps, losses = r[name]
            assert [s for s, _ in evals] == [3], (name, evals)  # the save at step 3 came right after an eval
            assert steps == [4, 5], (name, steps)
            assert max(abs(a - b) for a, b in zip(losses, ref[3:])) <= 1e-5, (name, losses, ref[3:])


def _stale_root(rank, world, tmp):
    """A save with FSDP's gathered root parameters still registered is refused before any file."""
    from seqpar.checkpoint import complete_checkpoints
    from seqpar.checkpoint.errors import IncompleteTrainingState
    from seqpar.config import load_run_config
    from seqpar.train.trainer import Trainer
    tmp = Path(tmp)
    tr = Trainer(load_run_config(None, run_overrides(tmp, {**RUN, **{"parallel.tp": 1, "parallel.data_parallel": "fsdp"}, "train.steps": 2})))
    try:
        tr.train_step(0)
        with torch.no_grad():  # a forward with no backward, and no reshard after it
            x, y = tr.micro_batches(1)[0]
            tr.model(x, y)
        with pytest.raises(IncompleteTrainingState, match="not the optimizer's"):
            tr.checkpoints.save(1)
        tr.engine.after_forward_only()
        tr.checkpoints.save(1)
    finally:
        tr.close()
    return [p.name for p in complete_checkpoints(tmp / "ckpt")]


def test_a_save_that_would_miss_entries_is_refused_before_writing(spawn, tmp_path):
    assert spawn(_stale_root, 4, str(tmp_path)) == [["step_00000001"]] * 4
