"""The one recipe (seqpar.parallel.apply): parallelism applied in its documented order, by both engines."""
import pytest
import torch

import seqpar.parallel.apply as recipe
from seqpar.config import load_run_config
from seqpar.distributed.mesh import ParallelMesh
from seqpar.model import GPT
from seqpar.parallel.engine import PlainEngine
from seqpar.parallel.precision import Precision

from run_helpers import TINY_MODEL


def _cfg(**extra):
    settings = {**TINY_MODEL, "model.heads": 2, "model.layers": 3, "model.recompute_layers": "[full,selective,none]",
                "parallel.tp_overlap": True, "train.compile": True, **extra}
    return load_run_config(None, [f"{k}={v}" for k, v in settings.items()])


def test_the_recipe_runs_its_steps_in_the_documented_order(monkeypatch):
    calls = []

    def spy(name):
        real = getattr(recipe, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(recipe, name, wrapper)

    for name in ("check_built_for", "apply_recompute", "apply_tp_overlap", "compile_blocks", "DataParallel"):
        spy(name)
    cfg = _cfg()
    engine = PlainEngine(cfg, ParallelMesh.single(), accum=1, precision=Precision("fp32", torch.device("cpu")),
                         probe=False)
    assert calls == ["check_built_for", "apply_recompute", "apply_tp_overlap", "compile_blocks", "DataParallel"]
    assert engine.applied.steps == list(recipe.RECIPE)
    # each step's effect is on the model: per-layer recompute, compiled blocks, the data-parallel wrapper
    assert engine.model.recompute_modes == ("full", "selective", "none")
    assert [b.attn.recompute for b in engine.model.blocks] == [False, True, False]
    assert engine.compiled.blocks == 3 and engine.data_parallel.module is engine.model
    assert cfg.model.recompute_layers == ("full", "selective", "none")  # the run's config is not rewritten


def test_the_recipe_refuses_a_part_built_for_another_mesh():
    cfg = _cfg(**{"train.compile": False, "parallel.tp_overlap": False})
    model = GPT(cfg.model)
    model.tp_size = 2  # as if built at t=2
    with pytest.raises(ValueError, match=r"built for tp=2 cp=1, the mesh has tp=1 cp=1"):
        recipe.apply_parallelism([model], cfg, ParallelMesh.single(), data_parallel=False)
