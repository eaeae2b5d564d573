"""The CUDA/NCCL paths, checked on CPU by standing in for what only a GPU machine has."""
import pytest
import torch
import torch.distributed as dist

from seqpar.distributed.mesh import MIXED_BACKEND, init_parallel
from seqpar.flops import peak_flops
from seqpar.model import GPT, GPTConfig


class _Stop(Exception):
    pass


def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def test_cuda_runs_get_the_mixed_backend(monkeypatch):
    """Plain "nccl" has no CPU backend: the loop's host-side scalars crashed every GPU run."""
    _fake_gpus(monkeypatch, 8)
    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(_Stop):
        init_parallel(tp=2, world_size=8, rank=3, init_method="file:///nonexistent")
    assert seen["backend"] == MIXED_BACKEND == "cpu:gloo,cuda:nccl"
    assert seen["device_id"] == torch.device("cuda", 3)


def test_more_local_ranks_than_gpus_fails_before_any_group(monkeypatch):
    _fake_gpus(monkeypatch, 2)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: pytest.fail("a group was created"))
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"LOCAL_WORLD_SIZE=4 .* only 2 GPU"):
        init_parallel(tp=2, world_size=4, rank=3, init_method="file:///nonexistent")


def _existing_gloo_group(rank, world):
    torch.cuda.is_available = lambda: True  # a GPU machine, as far as seqpar can tell
    mesh = init_parallel(tp=2)
    return str(mesh.device), str(dist.get_backend())


def test_an_existing_gloo_group_keeps_ranks_on_cpu(spawn):
    """Tests that start gloo ranks on a GPU machine stay on CPU instead of grabbing a GPU."""
    assert spawn(_existing_gloo_group, 2) == [("cpu", "gloo")] * 2


def test_dropout_streams_follow_the_model_device():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1, dropout=0.5))
    assert model.rng.device == torch.device("cpu")
    model.to(torch.float64)  # same device: the streams keep their state
    assert model.rng.device == torch.device("cpu")
    model.to("meta")
    assert model.rng.device == torch.device("meta")


def test_streams_that_have_drawn_refuse_to_move():
    model = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1, dropout=0.5))
    model(torch.zeros(1, 8, dtype=torch.long))  # draws dropout masks
    with pytest.raises(RuntimeError, match="already drawn on cpu"):
        model.to("meta")


@pytest.mark.parametrize("name, tflops", [("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835),
                                          ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
                                          ("NVIDIA H100 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312)])
def test_peak_table_tells_the_variants_apart(name, tflops, monkeypatch):
    monkeypatch.delenv("SEQPAR_PEAK_TFLOPS", raising=False)
    assert peak_flops(name) == tflops * 1e12


def test_peak_override(monkeypatch):
    monkeypatch.setenv("SEQPAR_PEAK_TFLOPS", "123.5")
    assert peak_flops("cpu") == 123.5e12
    monkeypatch.setenv("SEQPAR_PEAK_TFLOPS", "fast")
    with pytest.raises(ValueError, match="SEQPAR_PEAK_TFLOPS"):
        peak_flops("NVIDIA H200")
