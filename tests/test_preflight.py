"""Runs refused before anything is built: a predicted peak above the device's memory (the planner's
formulas; host RAM on the CPU) and a config file that sets nothing. One line, exit 2."""
import numpy as np
import pytest
import torch

from seqpar.config import load_run_config
from seqpar.config.errors import run_entry_point
from seqpar.plan.memory import FRAGMENTATION
from seqpar.train.launch import main as train_main
from seqpar.train.preflight import check_memory, device_memory, host_memory_bytes, predicted_peak
from seqpar.train.resolve import resolve_run

TINY = ["model.vocab_size=128", "model.seq_len=32", "model.hidden=32", "model.heads=4", "model.layers=2",
        "train.micro_batch=4", "train.steps=1", "train.eval_interval=0"]


def _train(tmp_path, capsys, *args) -> tuple[int, str]:
    """``seqpar train ARGS`` in this process (the entry point's error path); its exit code and stderr."""
    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.arange(4000, dtype=np.uint16) % 128)
    paths = [f"data.source={tokens}", f"checkpoint.dir={tmp_path / 'ckpt'}", f"out_dir={tmp_path / 'out'}"]
    code = run_entry_point("seqpar train", train_main, [*args, *paths, "checkpoint.resume=never"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("shape, term", [("model.layers=1000000", "activations"),
                                         ("model.seq_len=1048576", "backward_transient")])
def test_a_run_predicted_above_the_device_memory_is_refused(tmp_path, capsys, shape, term):
    code, err = _train(tmp_path, capsys, *TINY, shape)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("seqpar train: predicted peak memory "), err
    assert "GiB per rank exceeds this host's RAM" in err and f"the largest term is {term} (" in err
    assert "train.memory_check=false" in err
    assert not (tmp_path / "out").exists()  # refused before anything was built or written


def test_the_estimate_is_the_planners_and_tiny_runs_pass():
    tiny = resolve_run(load_run_config(None, TINY), 1)
    check_memory(tiny, "cpu", local_ranks=4)  # a few MiB: passes
    peak = predicted_peak(tiny, "cpu")
    others = sum(v for k, v in peak.parts.items() if k != "workspace")
    assert peak.parts["workspace"] == pytest.approx(FRAGMENTATION * others)  # no CUDA workspace on the CPU
    assert predicted_peak(tiny, "cuda").parts["workspace"] > 2 * 2**30  # the planner's GPU allowance
    huge = resolve_run(load_run_config(None, [*TINY, "model.layers=1000000", "train.memory_check=false"]), 1)
    check_memory(huge, "cpu")  # the escape hatch
    ram = host_memory_bytes()
    assert ram and device_memory(torch.device("cpu"), 4)[0] == ram / 4


def test_a_config_file_that_sets_nothing_is_refused(tmp_path, capsys):
    for text in ("", "# nothing yet\n", "model:\n"):
        path = tmp_path / "run.yaml"
        path.write_text(text)
        code, err = _train(tmp_path, capsys, str(path))
        assert code == 2 and err.count("\n") == 1, err
        assert f"config file '{path}' sets no key" in err and "leave the file out" in err
