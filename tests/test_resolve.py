"""The resolved run (:func:`seqpar.train.resolve.resolve_run`): a read-only copy of the config,
so nothing built from it (the Trainer, the model, the data) can rewrite what the run is."""
import dataclasses
import pickle

import pytest

from seqpar.config import load_run_config
from seqpar.model import GPT
from seqpar.train.resolve import ResolvedRun, resolve_run


def _cfg(*overrides):
    return load_run_config(None, ["model.layers=2", "model.hidden=32", "model.heads=4", "model.seq_len=16",
                                  "model.vocab_size=64", *overrides])


def test_the_resolved_config_is_a_read_only_copy():
    cfg = _cfg("data.sources=[{source: a.npy, weight: 3}, {source: b.npy}]")
    run = resolve_run(cfg, world_size=1)
    assert run.cfg is not cfg and run.cfg == dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, sources=tuple(cfg.data.sources)))
    for section, key, value in (("train", "steps", 5), ("model", "heads", 2), ("parallel", "tp", 2),
                                ("data", "source", "x"), ("checkpoint", "dir", "x")):
        with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{key}'"):
            setattr(getattr(run.cfg, section), key, value)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.cfg.train = cfg.train
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.cfg.data.sources[0].weight = 1.0
    with pytest.raises(AttributeError):  # a tuple now: no append
        run.cfg.data.sources.append(cfg.data.sources[0])
    with pytest.raises(dataclasses.FrozenInstanceError):
        del run.cfg.model.dropout
    cfg.train.steps = 7  # the caller's config stays its own, and changeable
    assert run.cfg.train.steps == 200
    again = pickle.loads(pickle.dumps(run))  # what a spawned rank receives is read-only too
    with pytest.raises(dataclasses.FrozenInstanceError):
        again.cfg.train.steps = 5
    direct = ResolvedRun(cfg=cfg, world_size=1, dp=1, accum=1, dp_mode="ddp", schedule=None)
    assert direct.cfg is not cfg and direct.cfg.train.steps == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        direct.cfg.model.layers = 1


def test_copies_of_a_frozen_config_can_change_and_models_keep_their_own():
    from seqpar.model.config import freeze

    frozen = freeze(_cfg())
    changed = dataclasses.replace(frozen.model, recompute="full")  # replace: a changeable copy
    changed.dropout = 0.0
    assert changed.recompute == "full" and frozen.model.recompute == "selective"
    model = GPT(frozen.model)  # the model copies the config and sets its recompute modes on its own copy
    model.set_recompute("none")
    assert model.recompute_modes == ("none",) * model.config.layers and frozen.model.recompute == "selective"
