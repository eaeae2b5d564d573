"""The dry run observes the Trainer's own step from outside (issue 32 item 3): it runs
:func:`seqpar.train.step.run_step`, the function ``Trainer.train_step`` runs, and on layouts that
also run here for real on 4 gloo ranks its step issues the real step's collectives (kind, group,
calls, bytes). The layouts exercise the transfers that run under computation: the overlapped TP
ring (``parallel.tp_overlap``, with seqpar's own bf16 gradient buckets over dp) and context
parallelism's K/V ring (with FSDP2 over cp), each step counted once, as a ``send_recv`` over its own group (before the
split of the collectives, the overlapped ring's sends were labelled ``world`` and their receives
counted a second time, as raw ``recv`` operators over tp)."""
from pathlib import Path

import seqpar.train.step as train_step
from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.tools.dryrun import step_group_names
from seqpar.tools.dryrun_comm import record_step
from seqpar.tools.dryrun_report import dry_run
from seqpar.train import Trainer

from run_helpers import run_overrides

SETTINGS = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 4, "model.layers": 2,
            "model.dropout": 0.0, "model.attention_dropout": 0.0, "model.sequence_parallel": True,
            "parallel.tp": 2, "train.micro_batch": 2, "train.global_batch": 4, "train.precision": "fp32",
            "train.steps": 1, "train.eval_interval": 0, "checkpoint.interval": 0}
LAYOUTS = {"t2dp2_overlap": {"parallel.tp_overlap": True, "train.precision": "bf16"},
           "t2cp2_ring": {"parallel.cp": 2, "parallel.cp_comm": "ring", "parallel.data_parallel": "fsdp"}}


def _config(tmp: Path, layout: str):
    return load_run_config(None, run_overrides(Path(tmp) / layout, {**SETTINGS, **LAYOUTS[layout]}))


def _real_steps(rank, world, tmp):
    out = {}
    for layout in LAYOUTS:
        cfg = _config(tmp, layout)
        trainer = Trainer(cfg, mesh=init_parallel(tp=2, cp=cfg.parallel.cp))
        try:
            with record_step(trainer.engine.module, step_group_names(trainer.mesh, trainer.engine)) as comm:
                trainer.train_step(0)
            out[layout] = comm.table()
        finally:
            trainer.close()
    return out


def test_the_dry_run_step_issues_the_real_steps_collectives(spawn, tmp_path):
    real = spawn(_real_steps, 4, str(tmp_path))
    for layout, ring in (("t2dp2_overlap", "tp"), ("t2cp2_ring", "cp")):
        (_, r, check), = dry_run(_config(tmp_path, layout), 4, [0], device="cpu")
        assert r.comm == real[0][layout], layout
        rows = {(row["group"], row["kind"]): row for row in r.comm}
        assert rows[(ring, "send_recv")]["calls"] > 0, (layout, sorted(rows))
        assert not {k for k in rows if k[1] in ("send", "recv") or k == ("world", "send_recv")}, (layout, sorted(rows))
        assert rows[("world", "all_reduce")]["calls"] == 1  # the step's flags
        assert not check.problems


def test_the_dry_run_runs_the_trainers_step_function(monkeypatch, tmp_path):
    calls = []
    run_step = train_step.run_step

    def spy(engine, optimizer, batches, **kwargs):
        calls.append((type(engine).__name__, len(batches), kwargs))
        return run_step(engine, optimizer, batches, **kwargs)

    monkeypatch.setattr(train_step, "run_step", spy)
    (_, r, _), = dry_run(_config(tmp_path, "t2cp2_ring"), 4, [0], device="cpu")
    assert calls == [("PlainEngine", r.micro_batches, {"grad_clip": 1.0})]
