"""End-to-end training on CPU gloo: the loss falls, layouts give the same curve, bad configs fail on
every rank before training, bf16 trains on CPU."""
import numpy as np
import pytest

from seqpar import init_parallel
from seqpar.config import load_run_config

from run_helpers import learnable_overrides, train_rank


def test_tp2_sp_selective_loss_falls(spawn, tmp_path):
    ov = learnable_overrides(tmp_path, **{"train.steps": 30, "model.recompute": "selective", "model.sequence_parallel": True,
                                 "parallel.tp": 2})
    h = spawn(train_rank, 2, ov, 2, 1)
    losses = h[0]["losses"]
    assert len(losses) == 30 and h[0]["losses"] == h[1]["losses"]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:3]), losses


def _tp2_then_dp2(rank, world, tp2, dp2):
    """Two layouts of 2 ranks in one spawn: t=2 (SP), then dp=2 with half the micro-batch."""
    return train_rank(rank, world, tp2, 2, 1)["losses"], train_rank(rank, world, dp2, 1, 2)["losses"]


def test_layouts_give_the_same_loss_curve(spawn, tmp_path):
    """(Gradient accumulation over dp ranks against one rank: tests/test_trainer.py and tests/test_fsdp.py.)"""
    common = {"model.recompute": "selective"}
    ref = spawn(train_rank, 1, learnable_overrides(tmp_path, **common, **{"model.sequence_parallel": False}), 1, 1)[0]["losses"]
    # dp=2 with half the micro-batch sees exactly the same windows per step as dp=1
    tp2, dp2 = spawn(_tp2_then_dp2, 2, learnable_overrides(tmp_path, **common, **{"parallel.tp": 2}),
                     learnable_overrides(tmp_path, **common, **{"train.micro_batch": 2, "model.sequence_parallel": False}))[0]
    for curve in (tp2, dp2):
        assert len(curve) == 20
        np.testing.assert_allclose(curve, ref, rtol=1e-4, atol=1e-4)


def _bad(rank, world, overrides):
    from seqpar.train import train
    try:
        train(load_run_config(None, overrides), mesh=init_parallel(tp=2))
    except ValueError as e:
        return str(e)
    return None


def test_bad_configs_fail_on_every_rank(spawn, tmp_path):
    msgs = spawn(_bad, 2, learnable_overrides(tmp_path, **{"parallel.tp": 2, "model.heads": 3, "model.hidden": 33}))
    assert all(m and "t=2" in m and "heads (3)" in m for m in msgs), msgs
    with pytest.raises(ValueError, match=r"unknown key 'train.stepz'"):
        load_run_config(None, ["train.stepz=3"])
    with pytest.raises(ValueError, match=r"train.steps"):
        load_run_config(None, ["train.steps=many"])


def test_cli_rejects_bad_config_before_starting(capsys):
    from seqpar.cli import main
    assert main(["train", "train.stepz=3"]) == 2
    assert "unknown key 'train.stepz'" in capsys.readouterr().err
    assert main(["train", "model.heads=3", "model.hidden=33", "parallel.tp=2"]) == 2
    assert "heads (3)" in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["bf16-autocast", "bf16"])
def test_bf16_on_cpu_trains(spawn, tmp_path, precision):
    ov = learnable_overrides(tmp_path, **{"parallel.tp": 2, "train.steps": 6, "train.precision": precision,
                                 "model.recompute": "selective"})
    losses = spawn(train_rank, 2, ov, 2, 1)[0]["losses"]
    assert len(losses) == 6 and all(np.isfinite(losses)) and losses[-1] < losses[0]

