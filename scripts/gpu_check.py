"""One-GPU check: a GPT-1.3B-class model at recompute none / selective / full.

    bash scripts/gpu_check.sh          (at most ~8 minutes on one H100/H200-class GPU)

Prints per mode: median step time (forward + backward + AdamW, bf16 autocast), model TFLOP/s,
MFU (paper App. A formula; peak from seqpar.flops), peak memory, and the paper's activation
formula for the same shape next to it.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from seqpar import flops
from seqpar.memory import bytes_per_layer
from seqpar.model import GPT, GPTConfig
from seqpar.train.optim import build_optimizer


def run(mode: str, s: int, b: int, steps: int, warmup: int) -> dict:
    cfg = GPTConfig(vocab_size=50304, seq_len=s, hidden=2048, heads=16, layers=24, dropout=0.1,
                    attention_dropout=0.1, recompute=mode, sequence_parallel=False, attention="math")
    torch.cuda.reset_peak_memory_stats()
    model = GPT(cfg, seed=0).cuda()
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = torch.randint(0, cfg.vocab_size, (b, s), device="cuda")
    static = torch.cuda.memory_allocated()
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    mf = flops.model_flops(B=b, s=s, h=cfg.hidden, L=cfg.layers, v=cfg.vocab_size)
    peak = flops.peak_flops(torch.cuda.get_device_name())
    tech = {"none": "none", "selective": "tp_selective", "full": "full"}[mode]
    formula = bytes_per_layer(tech, s=s, b=b, h=cfg.hidden, a=cfg.heads, t=1) * cfg.layers
    out = dict(mode=mode, step_s=dt, tflops=mf / dt / 1e12, mfu=(mf / dt / peak) if peak else float("nan"),
               peak_gib=torch.cuda.max_memory_allocated() / 2**30, static_gib=static / 2**30,
               formula_gib=formula / 2**30, loss=float(loss))
    del model, opt
    torch.cuda.empty_cache()
    return out


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device", file=sys.stderr)
        return 1
    s, b = 2048, int(argv[0]) if argv else 4
    print(f"{torch.cuda.get_device_name()}: GPT 1.3B-class (24L, h=2048, a=16, s={s}, b={b}), bf16 autocast, "
          f"fp32 master weights, dropout 0.1, math attention", flush=True)
    rows = []
    for mode in ("none", "selective", "full"):
        rows.append(run(mode, s, b, steps=8, warmup=3))
        r = rows[-1]
        print(f"  {mode}: {r['step_s'] * 1e3:.0f} ms/step", flush=True)
    base = rows[0]["step_s"]
    print("\n| recompute | ms / step | vs none | model TFLOP/s | MFU | peak GiB | weights+optimizer GiB | "
          "formula activations GiB (16-bit) |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['step_s'] * 1e3:.0f} | {r['step_s'] / base:.3f} | {r['tflops']:.1f} | "
              f"{r['mfu']:.1%} | {r['peak_gib']:.1f} | {r['static_gib']:.1f} | {r['formula_gib']:.1f} |")
    print(f"\npaper: selective adds s/(6h) = {2048 / (6 * 2048):.1%} model FLOPs; full recompute ~+33%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
