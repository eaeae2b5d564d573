"""The CUDA/NCCL paths, checked on CPU by standing in for what only a GPU machine has."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend

from seqpar.distributed import RNGStreams, capture_rng, restore_rng

from seqpar.distributed.mesh import MIXED_BACKEND, init_parallel
from seqpar.flops import peak_flops
from seqpar.model import GPT, GPTConfig


class _Stop(Exception):
    pass


def _fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


def _capture_init(monkeypatch, *, local_rank: int, local_world: int) -> dict:
    """``init_process_group``'s keyword arguments, caught (the call then stops with ``_Stop``)."""
    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", fake_init)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    return seen


def test_cuda_runs_get_the_mixed_backend(monkeypatch):
    """Plain "nccl" has no CPU backend: the loop's host-side scalars crashed every GPU run."""
    _fake_gpus(monkeypatch, 8)
    seen = _capture_init(monkeypatch, local_rank=3, local_world=8)
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


# ---------------------------------------------------------------- recompute replays the same SDPA kernel
def _grad_dependent_choice(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
    """Stands in for a GPU whose SDPA choice depends on grad mode (sm86/89 with head_dim > 192):
    flash without grad, math with it."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return int(SDPBackend.MATH if grad else SDPBackend.FLASH_ATTENTION)


def test_checkpoint_first_pass_and_replay_pin_the_same_sdpa_kernel(monkeypatch):
    """Before the fix the no-grad first pass and the grad-on replay let PyTorch choose, and the
    choice can differ between them (a different kernel draws a different dropout mask)."""
    import seqpar.recompute as recompute
    monkeypatch.setattr(torch, "_fused_sdp_choice", _grad_dependent_choice)
    pinned, real = [], recompute.sdpa_kernel

    def recording(backends, *args, **kwargs):
        pinned.append((torch.is_grad_enabled(), tuple(backends)))
        return real(backends, *args, **kwargs)

    monkeypatch.setattr(recompute, "sdpa_kernel", recording)
    cfg = GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=1, attention="sdpa",
                    recompute="selective", dropout=0.0, attention_dropout=0.0)
    model = GPT(cfg)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    model(tokens, tokens).backward()
    assert [grad for grad, _ in pinned] == [False, True], pinned  # the first pass, then the replay
    assert pinned[0][1] == pinned[1][1] == (SDPBackend.MATH,), pinned


def test_sdpa_selective_recompute_with_dropout_is_bit_identical():
    cfg = dict(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2, attention="sdpa", dropout=0.1,
               attention_dropout=0.3)
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    grads = []
    for mode in ("none", "selective"):
        model = GPT(GPTConfig(**cfg, recompute=mode), seed=3)
        model(tokens, tokens).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


# ---------------------------------------------------------------- RNG streams across device types
def _fake_cuda_streams(seed: int, tp_rank: int) -> dict:
    """What a GPU run's streams save: 16-byte Philox states (seed, offset), tagged cuda."""
    def philox(s):
        return torch.tensor([s, 0], dtype=torch.int64).view(torch.uint8)
    return {"replicated": philox(seed), "tp": philox(seed + 2718 + tp_rank), "device_type": "cuda"}


def _draws(streams: RNGStreams) -> tuple[torch.Tensor, torch.Tensor]:
    out = []
    for name in ("replicated", "tp"):
        with streams.fork(name):
            out.append(torch.rand(4))
    return tuple(out)


def test_cuda_rng_state_restored_on_cpu_reseeds_deterministically_and_says_so():
    """Before the fix the CUDA state went into the CPU stream unchecked: "RNG state is wrong size"
    at the first dropout."""
    draws = []
    for tp_rank in (0, 1, 1):
        streams = RNGStreams(5, tp_rank=tp_rank)
        assert "saved on cuda are restored on cpu" in streams.set_state(_fake_cuda_streams(5, tp_rank))
        draws.append(_draws(streams))
    assert torch.equal(draws[1][0], draws[2][0]) and torch.equal(draws[1][1], draws[2][1])  # deterministic
    assert torch.equal(draws[0][0], draws[1][0])       # replicated: the same on every TP rank
    assert not torch.equal(draws[0][1], draws[1][1])   # per TP rank: different masks


def test_untagged_cuda_sized_state_is_recognised():
    saved = _fake_cuda_streams(5, 0)
    del saved["device_type"]  # a checkpoint written before the device type was recorded
    streams = RNGStreams(5)
    assert "saved on cuda" in streams.set_state(saved)
    _draws(streams)


def test_same_device_state_round_trips_exactly():
    a = RNGStreams(7, tp_rank=1)
    _draws(a)
    state = a.get_state()
    assert state["device_type"] == "cpu"
    b = RNGStreams(0)
    assert b.set_state(state) is None
    assert all(torch.equal(x, y) for x, y in zip(_draws(a), _draws(b)))


def test_global_cpu_state_restored_after_cpu_streams_checkpoint(tmp_path):
    """The checkpoint path: a snapshot written with torch.save and read with weights_only."""
    streams = RNGStreams(1)
    snap = capture_rng(streams)
    torch.save(snap, tmp_path / "rng.pt")
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True), streams)
    assert streams.get_state()["device_type"] == "cpu"


# ---------------------------------------------------------------- building a GPT leaves the caller's RNG alone
def test_building_a_gpt_reseeds_no_generator(monkeypatch):
    """Before the fix torch.manual_seed inside the build also reseeded every CUDA generator
    (queued until CUDA initialises when it is not yet)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(("all", seed)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(("one", seed)))
    torch.manual_seed(99)  # the caller's own seeding (recorded too: the patch sees it)
    calls.clear()
    before = torch.get_rng_state()
    a = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2), seed=4)
    assert calls == [], calls
    assert torch.equal(torch.get_rng_state(), before)
    b = GPT(GPTConfig(vocab_size=32, seq_len=8, hidden=16, heads=2, layers=2), seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_per_shard_init_reseeds_no_cuda_generator(monkeypatch):
    """``per_shard_init`` seeds only its shard's generator; torch.manual_seed there reseeded every
    CUDA device (queued until CUDA initialises when it is not yet)."""
    from seqpar.layers._init import build_param, default_linear_init
    from seqpar.sharding import ParamLayout

    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(("all", seed)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(("one", seed)))
    before = torch.get_rng_state()
    shards = [build_param((8, 4), ParamLayout(split_dim=0), r, 2, default_linear_init, dtype=None, device=None,
                          per_shard_init=True) for r in range(2)]
    assert calls == [], calls
    assert not torch.equal(shards[0], shards[1])  # rank-offset streams
    assert not torch.equal(torch.get_rng_state(), before)  # the one shared draw of the seed advanced the CPU RNG


# ---------------------------------------------------------------- gloo ranks on one GPU (validation)
def test_gloo_ranks_can_share_one_gpu(monkeypatch):
    """init_parallel(backend="gloo", device="cuda:0"): every rank on the one GPU, the group gloo
    (NCCL refuses two ranks on one device), no device_id bound."""
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    seen = _capture_init(monkeypatch, local_rank=1, local_world=2)
    with pytest.raises(_Stop):
        init_parallel(tp=2, world_size=2, rank=1, init_method="file:///nonexistent", backend="gloo", device="cuda:0")
    assert seen["backend"] == "gloo" and "device_id" not in seen


def test_an_explicit_cuda_device_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: pytest.fail("a group was created"))
    with pytest.raises(ValueError, match=r"device='cuda:0'.*no GPU"):
        init_parallel(tp=2, world_size=2, rank=0, init_method="file:///nonexistent", backend="gloo", device="cuda:0")
