"""Check 4 of scripts/gpu_validate.py: step time, MFU and peak memory of a 1.3B-class GPT at
recompute none / selective / full (``shapes`` is ``gpu_validate.Shapes``)."""
from __future__ import annotations

import gc
import statistics
import time

import torch

from gpu_common import Row, batch, fmt_bytes, sync, verdict
from seqpar import flops
from seqpar.distributed import ParallelMesh
from seqpar.memory import ActivationLedger
from seqpar.model import GPT, GPTConfig
from seqpar.parallel.compile import compile_blocks, compile_seconds, uncompile_blocks
from seqpar.train.optim import build_optimizer


def time_mode(model: GPT, opt, tokens: torch.Tensor, mode: str, shapes) -> dict:
    """Median step time (forward, backward, AdamW) and peak memory of ``model`` at recompute ``mode``."""
    model.set_recompute(mode)
    dev = tokens.device
    times = []
    for i in range(shapes.warmup + shapes.steps):
        if i == shapes.warmup and dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sync(dev)
        t0 = time.perf_counter()
        loss = model(tokens, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        if i >= shapes.warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    if peak is None:  # on the CPU: the activations one forward keeps, by the ledger
        with ActivationLedger(model) as ledger:
            model(tokens, tokens)
        peak = ledger.total()
    return {"step_s": statistics.median(times), "peak": peak, "loss": float(loss.detach())}


def time_core(model: GPT, b: int, shapes) -> float:
    """Median seconds of one layer's attention core forward with autograd recording, as selective
    recompute replays it in backward (the core's inputs at the model's shape and dtype)."""
    core, cfg = model.blocks[0].attn.core, model.config
    dev = next(model.parameters()).device
    dt = next(model.parameters()).dtype
    q, k, v = (torch.randn(cfg.seq_len, b, cfg.heads, cfg.head_dim, device=dev, dtype=dt, requires_grad=True)
               for _ in range(3))
    times = []
    for i in range(shapes.warmup + shapes.steps):
        sync(dev)
        t0 = time.perf_counter()
        out = core(q, k, v)
        sync(dev)
        if i >= shapes.warmup:
            times.append(time.perf_counter() - t0)
        del out
    return statistics.median(times)


def time_compiled(model: GPT, opt, tokens: torch.Tensor, shapes) -> dict:
    """The same step with every block compiled (train.compile) at recompute selective; the first
    step's compilation is timed apart (compile seconds per block shape)."""
    start = compile_seconds()
    report = compile_blocks(model)
    model.set_recompute("selective")
    sync(tokens.device)
    t0 = time.perf_counter()
    model(tokens, tokens).backward()  # traces and compiles forward and backward
    opt.zero_grad(set_to_none=True)
    sync(tokens.device)
    first_s, compile_s = time.perf_counter() - t0, compile_seconds() - start
    out = time_mode(model, opt, tokens, "selective", shapes)
    uncompile_blocks(model)
    return out | {"first_s": first_s, "compile_s": compile_s, "blocks": report.blocks}


def compiled_rows(res: dict[str, dict], compiled: dict, cfg: GPTConfig, device: str) -> list[Row]:
    """Compiled vs eager selective: step time (asserted on CUDA: compiled no slower), peak memory,
    and the compilation's cost."""
    on_gpu = device == "cuda"
    ratio = res["selective"]["step_s"] / compiled["step_s"]
    note = "" if on_gpu else " (tiny CPU run: shown, asserted on CUDA only)"
    return [Row(f"compiled selective: step time and tokens/s vs eager{note}",
                f"{compiled['step_s'] * 1e3:.1f} ms vs {res['selective']['step_s'] * 1e3:.1f} ms: "
                f"{ratio:.3f}x eager's tokens/s", ">= 1.0", verdict(ratio >= 1.0) if on_gpu else "INFO"),
            Row("compiled selective: peak memory vs eager", f"{fmt_bytes(compiled['peak'])} vs "
                f"{fmt_bytes(res['selective']['peak'])}", "-", "INFO"),
            Row(f"compile time ({compiled['blocks']} blocks of one shape, {cfg.layers}L h={cfg.hidden})",
                f"{compiled['compile_s']:.1f} s compiling; first step {compiled['first_s']:.1f} s", "-", "INFO")]


def selective_bound(res: dict[str, dict], core_s: float, layers: int) -> tuple[float, float]:
    """(selective - none) step time over the time of re-running every layer's attention core once:
    what selective recompute adds should be that replay, give or take launch and allocator noise."""
    extra = res["selective"]["step_s"] - res["none"]["step_s"]
    return extra / (layers * core_s), layers * core_s


def throughput_rows(res: dict[str, dict], cfg: GPTConfig, b: int, device: str, core_s: float) -> list[Row]:
    """Rows of check 4: per-mode timing (INFO), the two time ratios and the memory order."""
    on_gpu = device == "cuda"
    mf = flops.model_flops(B=b, s=cfg.seq_len, h=cfg.hidden, L=cfg.layers, v=cfg.vocab_size)
    peak_flops = flops.peak_flops(torch.cuda.get_device_name()) if on_gpu else None
    mem = "peak memory" if on_gpu else "activation bytes (ledger)"
    rows = []
    for mode, r in res.items():
        mfu = f"MFU {mf / r['step_s'] / peak_flops:.1%}" if peak_flops else "MFU n/a (unknown peak)"
        rows.append(Row(f"throughput {mode}", f"{r['step_s'] * 1e3:.1f} ms/step, {mf / r['step_s'] / 1e12:.3g} "
                        f"TFLOP/s, {mfu}, {mem} {fmt_bytes(r['peak'])}", "-", "INFO"))
    note = "" if on_gpu else " (tiny CPU run: shown, asserted on CUDA only)"
    sel, full = (res[m]["step_s"] / res["none"]["step_s"] for m in ("selective", "full"))
    # selective's cost is one more forward of each layer's attention core, whatever share of the
    # step that core is at this shape (math attention with dropout at s = h = 2048 is a large one)
    ratio, replay_s = selective_bound(res, core_s, cfg.layers)
    rows.append(Row(f"throughput selective / none{note}", f"{sel:.3f}", "-", "INFO"))
    rows.append(Row(f"throughput selective - none vs {cfg.layers} attention-core forwards{note}",
                    f"{(sel - 1) * res['none']['step_s'] * 1e3:.1f} ms vs {replay_s * 1e3:.1f} ms = {ratio:.2f}",
                    "<= 1.3", verdict(ratio <= 1.3) if on_gpu else "INFO"))
    rows.append(Row(f"throughput full / none{note}", f"{full:.3f}", "in [1.2, 1.45]",
                    verdict(1.2 <= full <= 1.45) if on_gpu else "INFO"))
    peaks = [res[m]["peak"] for m in ("none", "selective", "full")]
    rows.append(Row(f"throughput {mem} none > selective > full",
                    " > ".join(fmt_bytes(p) for p in peaks), "strictly decreasing",
                    verdict(peaks[0] > peaks[1] > peaks[2])))
    return rows


def check_throughput(device: str, shapes) -> list[Row]:
    """Check 4: step time of recompute none / selective / full on one model (bf16 parameters,
    dropout 0.1, math attention)."""
    mesh = ParallelMesh.single(device)
    cfg = GPTConfig(**shapes.big, dropout=0.1, attention_dropout=0.1, recompute="none", sequence_parallel=False,
                    attention="math", dtype="bfloat16")
    model = GPT(cfg, mesh, seed=0)
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = batch(cfg.vocab_size, shapes.big_batch, cfg.seq_len, mesh.device)[0]
    res = {mode: time_mode(model, opt, tokens, mode, shapes) for mode in ("none", "selective", "full")}
    core_s = time_core(model, shapes.big_batch, shapes)
    compiled = time_compiled(model, opt, tokens, shapes)
    del model, opt
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return throughput_rows(res, cfg, shapes.big_batch, device, core_s) + compiled_rows(res, compiled, cfg, device)
