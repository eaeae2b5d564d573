"""Input that cannot be right is refused in one line naming it, and the public API checks its
arguments: duplicate YAML keys, a negative seed, a checkpoint.dir that is a file, train.steps below
the checkpoint's step, a seed change on resume, a multi-rank layout started as one process, wrong
argument types and a mesh that contradicts the config."""
import pytest
import torch

from run_helpers import TINY_MODEL, run_overrides
from seqpar import init_parallel, parallelize
from seqpar.cli import main as seqpar
from seqpar.config import load_run_config
from seqpar.distributed.mesh import ParallelMesh
from seqpar.errors import UserError
from seqpar.train import Trainer, train

RUN = {**TINY_MODEL, "model.layers": 1, "model.heads": 2, "train.micro_batch": 2, "train.log_interval": 1,
       "train.eval_interval": 0, "checkpoint.interval": 2, "train.precision": "fp32", "train.memory_check": False}


def _one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


def test_duplicate_yaml_keys_are_refused_naming_the_key_and_lines(tmp_path):
    (tmp_path / "run.yaml").write_text("train:\n  steps: 3\n  lr: 0.1\n  steps: 5\n")
    with pytest.raises(UserError) as err:
        load_run_config(tmp_path / "run.yaml", [])
    assert "'steps' is given twice" in _one_line(err.value) and "lines 2 and 4" in str(err.value)


def test_a_negative_seed_is_refused_by_the_config():
    with pytest.raises(UserError, match=r"train.seed must be >= 0, got -1"):
        load_run_config(None, ["train.seed=-1"])


def test_a_multi_rank_layout_started_as_one_process_names_the_flag(capsys):
    assert seqpar(["train", "tiny-cpu", "train.steps=1"]) == 2
    assert "--nproc-per-node 2" in capsys.readouterr().err


def test_trainer_and_parallelize_and_init_parallel_check_argument_types(tmp_path):
    with pytest.raises(UserError, match=r"Trainer\(cfg\): cfg must be a RunConfig .* got dict"):
        Trainer({})
    cfg = load_run_config(None, run_overrides(tmp_path, RUN))
    with pytest.raises(UserError, match=r"mesh must be a ParallelMesh .* got str"):
        Trainer(cfg, mesh="tp=2")
    with pytest.raises(UserError, match=r"parallelize\(plan=...\): plan must be a Plan"):
        parallelize(torch.nn.Linear(4, 4), None, None)
    with pytest.raises(UserError, match=r"parallelize\(model=...\): model must be a torch.nn.Module"):
        parallelize("gpt2", {}, None)
    with pytest.raises(UserError, match=r"init_parallel\(tp='2'\): tp must be an int >= 1"):
        init_parallel(tp="2")


def test_a_checkpoint_dir_that_is_a_file_is_named(tmp_path):
    (tmp_path / "ckpt").write_text("not a folder")
    with pytest.raises(UserError, match=r"checkpoint.dir=.*ckpt is a file, not a folder"):
        Trainer(load_run_config(None, run_overrides(tmp_path, RUN)), mesh=ParallelMesh.single())


def test_resume_below_the_checkpoint_or_with_another_seed_is_refused(tmp_path):
    base = run_overrides(tmp_path, RUN) + ["checkpoint.resume=auto"]
    train(load_run_config(None, base + ["train.steps=2"]), mesh=ParallelMesh.single())
    with pytest.raises(UserError) as err:
        train(load_run_config(None, base + ["train.steps=1"]), mesh=ParallelMesh.single())
    assert "train.steps=1 is below the step of checkpoint" in _one_line(err.value)
    with pytest.raises(UserError) as err:
        train(load_run_config(None, base + ["train.steps=4", "train.seed=5"]), mesh=ParallelMesh.single())
    assert "train.seed=5 differs from the checkpoint's train.seed=1234" in _one_line(err.value)


def _mesh_against_config(rank, world, tmp):
    cfg = load_run_config(None, run_overrides(tmp, RUN) + ["parallel.tp=1"])
    try:
        Trainer(cfg, mesh=init_parallel(tp=2))
    except UserError as e:
        return str(e)
    return "accepted"


def test_a_mesh_that_contradicts_the_config_is_refused_on_every_rank(spawn, tmp_path):
    said = spawn(_mesh_against_config, 2, tmp_path)
    assert all("parallel.tp=1 but mesh tp=2" in s and "parallel.dp=2 but mesh dp=1" in s for s in said), said


def test_a_text_file_of_random_bytes_is_refused_naming_it_and_the_count(tmp_path, capsys):
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "good.txt").write_text("def x ( ) : return x\n" * 200 + "caf\u00e9 \ufffd\n")
    (tmp_path / "texts" / "noise.txt").write_bytes(np.random.default_rng(0).integers(0, 256, 4000,
                                                                                      dtype=np.uint8).tobytes())
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<|endoftext|>", "<unk>", "def", "x"])},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    settings = {**RUN, "train.steps": 1, "model.vocab_size": 300}
    overrides = [o for o in run_overrides(tmp_path, settings) if not o.startswith("data.source")]
    data = [f"data.tokenizer={tmp_path / 'tokenizer.json'}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert seqpar(["train", *overrides, *data, f"data.source={tmp_path / 'texts'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "noise.txt" in err[0] and "undecodable sequences in 4,000 bytes" in err[0], err
    (tmp_path / "texts" / "noise.txt").unlink()  # a stray U+FFFD or accented text is fine
    assert seqpar(["train", *overrides, *data, f"data.source={tmp_path / 'texts'}",
                   f"checkpoint.dir={tmp_path / 'ck2'}"]) == 0


def test_an_out_dir_in_use_by_a_running_job_is_refused(tmp_path):
    from seqpar.checkpoint.files import OUT_LOCK, CheckpointDir

    other = CheckpointDir(tmp_path / "out", OUT_LOCK, "out_dir")
    other.lock()  # another job's hold (flock: separate open files conflict, in one process too)
    try:
        with pytest.raises(UserError) as err:
            Trainer(load_run_config(None, run_overrides(tmp_path, RUN)), mesh=ParallelMesh.single())
        assert f"out_dir {tmp_path / 'out'} is in use by another job (host" in _one_line(err.value)
    finally:
        other.close()
    Trainer(load_run_config(None, run_overrides(tmp_path, RUN)), mesh=ParallelMesh.single()).close()
