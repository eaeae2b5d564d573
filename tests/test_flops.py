"""Appendix A FLOP counts, §5's overhead figures and Table 5's MFU / HFU, via seqpar.flops."""
import pytest

from seqpar.flops import (
    attention_core_forward_flops,
    hardware_flops,
    hfu,
    layer_forward_flops,
    logits_forward_flops,
    model_flops,
    mfu,
    peak_flops,
    selective_overhead,
)

A100 = 312e12
# Table 3 / Table 5: (global batch B, h, L, GPUs, iteration s with this work, MFU %, HFU %).
TABLE5 = {
    "22B": (4, 6144, 48, 8, 1.10, 41.5, 43.7),
    "175B": (64, 12288, 96, 64, 13.75, 51.4, 52.8),
    "530B": (280, 20480, 105, 280, 37.83, 56.0, 57.0),
    "1T": (512, 25600, 128, 512, 71.49, 56.3, 57.0),
}
S, V = 2048, 51200


@pytest.mark.parametrize("B,s,h,L,v", [(4, 2048, 6144, 48, 51200), (1, 2048, 12288, 96, 51200), (3, 100, 64, 5, 7)])
def test_model_flops_is_three_forwards(B, s, h, L, v):
    fwd = L * layer_forward_flops(B=B, s=s, h=h) + logits_forward_flops(B=B, s=s, h=h, v=v)
    assert model_flops(B=B, s=s, h=h, L=L, v=v) == 3 * fwd
    assert model_flops(B=B, s=s, h=h, L=L, v=v) == pytest.approx(
        72 * B * L * s * h**2 * (1 + s / (6 * h) + v / (12 * h * L)), rel=1e-12)
    assert layer_forward_flops(B=B, s=s, h=h) == 24 * B * s * h**2 + 4 * B * s**2 * h
    assert hardware_flops("none", B=B, s=s, h=h, L=L, v=v) == model_flops(B=B, s=s, h=h, L=L, v=v)
    assert hardware_flops("selective", B=B, s=s, h=h, L=L, v=v) == pytest.approx(
        72 * B * L * s * h**2 * (1 + s / (3 * h) + v / (12 * h * L)), rel=1e-12)
    full = hardware_flops("full", B=B, s=s, h=h, L=L, v=v)
    assert full == pytest.approx(96 * B * L * s * h**2 * (1 + s / (6 * h)) + 6 * B * s * h * v, rel=1e-12)
    assert full == model_flops(B=B, s=s, h=h, L=L, v=v) + L * layer_forward_flops(B=B, s=s, h=h)
    assert attention_core_forward_flops(B=B, s=s, h=h) == 4 * B * s**2 * h


def test_selective_overhead_matches_section5():
    assert round(100 * selective_overhead(2048, 12288), 1) == 2.7  # GPT-3
    assert round(100 * selective_overhead(2048, 20480), 1) == 1.6  # MT-NLG
    B, h, L = 1, 12288, 96
    extra = hardware_flops("selective", B=B, s=S, h=h, L=L, v=V) - model_flops(B=B, s=S, h=h, L=L, v=V)
    assert extra == L * 3 * attention_core_forward_flops(B=B, s=S, h=h)


def test_full_recompute_costs_about_a_third_more_flops():
    for B, h, L, *_ in TABLE5.values():
        ratio = hardware_flops("full", B=B, s=S, h=h, L=L, v=V) / model_flops(B=B, s=S, h=h, L=L, v=V)
        assert 1.30 < ratio < 1.34


@pytest.mark.parametrize("name", list(TABLE5))
def test_table5_mfu_hfu(name):
    B, h, L, gpus, secs, mfu_pct, hfu_pct = TABLE5[name]
    m = mfu(model_flops(B=B, s=S, h=h, L=L, v=V), secs, A100, gpus)
    hw = hfu(hardware_flops("selective", B=B, s=S, h=h, L=L, v=V), secs, A100, gpus)
    assert 100 * m == pytest.approx(mfu_pct, abs=0.2)  # iteration times are quoted to 0.01 s
    assert 100 * hw == pytest.approx(hfu_pct, abs=0.2)
    assert hw / m == pytest.approx(hfu_pct / mfu_pct, abs=0.002)  # Appendix A's selective count


def test_peak_flops_lookup():
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("cpu") is None
    assert peak_flops("Some Unknown Accelerator") is None
    with pytest.raises(ValueError):
        mfu(1.0, 0.0, A100)
    with pytest.raises(ValueError, match="unknown recompute mode"):
        hardware_flops("partial", B=1, s=1, h=1, L=1, v=1)  # type: ignore[arg-type]


def _trainer_step_flops(cfg, micro_batch: int, accum: int, dp: int, tp: int) -> float:
    """The model FLOPs per optimizer step the Trainer divides by for TFLOP/s and MFU, read from
    the Trainer's own method on the attributes it uses."""
    from types import SimpleNamespace

    from seqpar.train.trainer import Trainer
    run = SimpleNamespace(cfg=SimpleNamespace(model=cfg), global_batch=micro_batch * accum * dp)
    fake = SimpleNamespace(run=run, mesh=SimpleNamespace(tp_size=tp, world_size=tp * dp))
    return Trainer._throughput(fake).flops_per_step


@pytest.mark.parametrize("name", ["tiny-cpu", "llama-tiny-cpu", "moe-tiny-cpu"])
def test_trainer_model_flops_are_the_counted_flops_of_a_step(name):
    """Model FLOPs count one forward and one backward of every matmul, with no recomputation
    (what MFU is defined on): the model is built with ``recompute: none`` and FlopCounterMode
    counts its one forward + backward on one rank (t = 1: the whole model, the vocabulary padded as
    the Trainer pads it). The shipped configs' SwiGLU, grouped-query attention and ffn_hidden != 4h
    (llama-tiny-cpu) must be in the Trainer's figure, not only GPT-2's 24h^2 per layer; an MoE
    layer's router, k experts per token and dense first layer too (moe-tiny-cpu)."""
    from dataclasses import replace

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from seqpar.config import load_run_config
    from seqpar.model import GPT

    run = load_run_config(name)
    cfg = replace(run.model, recompute="none", recompute_layers=None, sequence_parallel=False)
    b = 2  # sequences of one micro-batch; the Trainer's step has micro_batch x accum x dp of them
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    model = GPT(cfg, seed=0)
    for block in model.blocks:  # FlopCounterMode has no formula for torch._grouped_mm: count the loop's GEMMs
        if hasattr(block.mlp, "experts"):
            block.mlp.experts.kernel = "loop"
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).backward()
    counted = counter.get_total_flops()
    assert _trainer_step_flops(cfg, micro_batch=1, accum=b, dp=1, tp=1) == pytest.approx(counted, rel=0.02)
    assert _trainer_step_flops(cfg, micro_batch=2, accum=3, dp=4, tp=1) == pytest.approx(2 * 3 * 4 / b * counted, rel=0.02)
