"""A dry run equals the real run (issue 22): on layouts that also run here for real on 4 gloo ranks
(t=2 x p=2, and t=2 x dp=2 under FSDP2), the dry run's figures for the first rank of the first and
of the last pipeline stage are the real run's: training-state bytes exactly, peak saved activations
within 1%, and the same collectives (kind, group, calls, bytes, and which of them the layers issued)."""
from pathlib import Path

from seqpar import init_parallel
from seqpar.config import load_run_config
from seqpar.train import Trainer
from seqpar.tools.dryrun import saved_activations, step_group_names
from seqpar.tools.dryrun_comm import record_step
from seqpar.tools.dryrun_report import dry_run

from run_helpers import run_overrides

SETTINGS = {"model.vocab_size": 64, "model.seq_len": 16, "model.hidden": 16, "model.heads": 4, "model.layers": 4,
            "model.dropout": 0.1, "model.attention_dropout": 0.1, "model.sequence_parallel": True,
            "model.recompute": "selective", "parallel.tp": 2, "train.micro_batch": 2, "train.global_batch": 8,
            "train.precision": "fp32", "train.steps": 1, "train.eval_interval": 0, "checkpoint.interval": 0}
LAYOUTS = {"t2p2": {"parallel.pp": 2}, "t2dp2_fsdp": {"parallel.data_parallel": "fsdp"}}


def _real_step(rank, world, tmp):
    out = {}
    for layout in LAYOUTS:
        cfg = load_run_config(None, run_overrides(Path(tmp) / layout, {**SETTINGS, **LAYOUTS[layout]}))
        trainer = Trainer(cfg, mesh=init_parallel(tp=2, pp=cfg.parallel.pp))
        try:
            with record_step(trainer.engine.module, step_group_names(trainer.mesh, trainer.engine)) as comm:
                trainer.train_step(0)
            out[layout] = {"state": trainer.state, "saved": saved_activations(trainer.engine), "comm": comm.table()}
        finally:
            trainer.close()
    return out


def test_the_dry_run_measures_what_the_real_run_measures(spawn, tmp_path):
    real = spawn(_real_step, 4, str(tmp_path))
    for layout, ranks, needed in (("t2p2", [0, 2], {("pp", "send"), ("pp", "recv")}),
                                  ("t2dp2_fsdp", [0], {("dp", "all_gather"), ("dp", "reduce_scatter")})):
        cfg = load_run_config(None, run_overrides(tmp_path / layout, {**SETTINGS, **LAYOUTS[layout]}))
        results = dry_run(cfg, 4, device="cpu")
        assert [r.rank for _, r, _ in results] == ranks  # the first rank of the first and of the last stage
        for _, r, check in results:
            ref = real[r.rank][layout]
            assert r.state == ref["state"] and min(r.state.values()) > 0
            for part in ("layers", "outside_layers"):
                assert 0 < r.saved[part] and abs(r.saved[part] - ref["saved"][part]) <= 0.01 * ref["saved"][part]
            assert r.comm == ref["comm"], (layout, r.rank)
            kinds = {(row["group"], row["kind"]) for row in r.comm}
            assert {("tp", "all_gather"), ("tp", "reduce_scatter")} | needed <= kinds
            assert not check.problems
