"""The Trainer with pipeline stages (parallel.pp > 1): the same run as p = 1, evaluation through the
pipeline, the launcher's bubble and memory lines, and checkpoints that resume at another pp."""
from pathlib import Path

import pytest

from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.train import Trainer

from run_helpers import SHARDED_RUN, run_overrides


RUN = {**SHARDED_RUN, "model.layers": 4, "train.steps": 6, "train.eval_interval": 5, "train.eval_batches": 2,
       "checkpoint.resume": "auto"}


def _run(tmp: Path, tp: int, pp: int, save_at: int | None = None, **extra) -> dict:
    trainer = Trainer(load_run_config(None, run_overrides(tmp, RUN, parallel__tp=tp, parallel__pp=pp, **extra)),
                      mesh=init_parallel(tp=tp, pp=pp))
    out = {"losses": [], "accum": trainer.run.accum, "micro_batch": trainer.run.cfg.train.micro_batch,
           "recipe": trainer.engine.applied.steps}
    try:
        start = out["start"] = (trainer.checkpoints.resume() or 0)
        for step in range(start, trainer.run.cfg.train.steps):
            out["losses"].append(trainer.train_step(step).loss)
            if step + 1 == save_at:
                trainer.checkpoints.save(save_at)
        out["eval"] = trainer.evaluate()
        out["lines"] = (trainer.engine.memory_line(), trainer.engine.log_lines())
    finally:
        trainer.close()
    return out


def _pipelines(rank, world, tmp):
    tmp = Path(tmp)
    return {"t2p2": _run(tmp / "t2p2", 2, 2, save_at=3),
            # interleaved, tied table on different stages, per-layer recompute modes (a slice per stage)
            "t1p2m2": _run(tmp / "t1p2m2", 1, 2, parallel__virtual_stages=2, model__tie_embeddings=True,
                           model__recompute_layers="[full,selective,none,full]"),
            "split": _run(tmp / "split", 2, 2, train__global_batch="null", train__micro_batch=4),
            # the paper's bf16 recipe inside the stages (bf16 copies, fp32 masters and reductions)
            "bf16": _run(tmp / "bf16", 2, 2, train__precision="bf16", checkpoint__resume="never")}


def _references(rank, world, tmp):
    tmp = Path(tmp)
    out = {"p1": _run(tmp / "p1", 1, 1), "p1_tied": _run(tmp / "p1_tied", 1, 1, model__tie_embeddings=True),
           "p1_split": _run(tmp / "p1_split", 1, 1, train__global_batch="null", train__micro_batch=4)}
    # the t=2 x p=2 checkpoint of step 3 resumes here at t=1 x p=1
    out["resumed"] = _run(tmp / "t2p2", 1, 1)
    return out


def test_pipeline_training_equals_one_stage_and_resumes_at_another_pp(spawn, tmp_path):
    res = spawn(_pipelines, 4, str(tmp_path))
    ref = spawn(_references, 1, str(tmp_path))[0]
    for r in res:  # every rank reports the same losses
        assert r["t2p2"]["losses"] == res[0]["t2p2"]["losses"]
    got = res[0]
    # both step kinds went through the one recipe; stages reduce over dp inside the pipeline step
    assert got["t2p2"]["recipe"] == ["tp/sp", "cp", "ep", "recompute", "overlap"]
    assert ref["p1"]["recipe"] == ["tp/sp", "cp", "ep", "recompute", "overlap", "data parallel"]
    assert got["t2p2"]["accum"] == 4 and len(got["t2p2"]["losses"]) == 6
    assert got["t2p2"]["losses"] == pytest.approx(ref["p1"]["losses"], abs=1e-5)
    assert got["t2p2"]["eval"] == pytest.approx(ref["p1"]["eval"], abs=1e-5)
    assert got["t1p2m2"]["losses"] == pytest.approx(ref["p1_tied"]["losses"], abs=1e-5)
    assert got["t1p2m2"]["eval"] == pytest.approx(ref["p1_tied"]["eval"], abs=1e-5)
    # without train.global_batch the step's batch stays micro_batch x dp, as pp micro-batches
    assert (got["split"]["accum"], got["split"]["micro_batch"]) == (2, 2)
    assert got["split"]["losses"] == pytest.approx(ref["p1_split"]["losses"], abs=1e-5)

    assert got["bf16"]["losses"] == pytest.approx(ref["p1"]["losses"], abs=1e-2)
    assert got["bf16"]["losses"] != got["t2p2"]["losses"]  # computed in bf16, not fp32
    # the pipeline checkpoint (step 3) continues at p = 1 as the pipeline run did
    assert ref["resumed"]["start"] == 3
    assert ref["resumed"]["losses"] == pytest.approx(got["t2p2"]["losses"][3:], abs=1e-5)
    memory, (bubble,) = got["t2p2"]["lines"]
    assert memory.startswith("activations: ") and "pipeline stage 0" in memory and "ratio" in memory
    assert "pipeline bubble" in bubble and "(p-1)/(m n) = 0.250" in bubble


def test_pipeline_config_errors_name_the_values():
    with pytest.raises(ValueError, match=r"model.layers=6 is not divisible into parallel.pp x parallel.virtual_stages = 2 x 2 = 4"):
        load_run_config(None, ["model.layers=6", "parallel.pp=2", "parallel.virtual_stages=2"])
    with pytest.raises(ValueError, match=r"pp_schedule=1F1B.*virtual_stages=2 needs Interleaved1F1B"):
        load_run_config(None, ["model.layers=8", "parallel.pp=2", "parallel.virtual_stages=2",
                               "parallel.pp_schedule=1F1B"])
    with pytest.raises(ValueError, match=r"data_parallel=fsdp with parallel.pp=2"):
        load_run_config(None, ["model.layers=8", "parallel.pp=2", "parallel.data_parallel=fsdp"])
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs parallel.pp > 1"):
        load_run_config(None, ["parallel.virtual_stages=2"])
