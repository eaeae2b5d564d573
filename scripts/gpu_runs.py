"""Training-run rows of scripts/gpu_validate.py, through seqpar's public API only (``Trainer``,
``train_step``, ``fit``, ``save_checkpoint``): resume bit for bit, resume on another device type,
bf16-autocast, host syncs per step, the Trainer's memory lines, asynchronous checkpoints, and
sdpa with dropout under recomputation (with the attention kernels it ran).

Every function returns rows (``gpu_validate.Row``); what only a GPU can measure is a SKIP row
saying "needs CUDA" in ``--device cpu`` mode.
"""
from __future__ import annotations

import contextlib
import io
import re
import shutil
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from gpu_common import NEEDS_CUDA, Row, host_syncs, verdict
from seqpar.checkpoint import save_checkpoint
from seqpar.config import load_run_config
from seqpar.distributed import ParallelMesh
from seqpar.model import GPT, GPTConfig
from seqpar.train import Trainer
from seqpar.train.optim import build_optimizer

VOCAB = 2048  # the token file's ids are below it (tiny-cpu's vocabulary)
# model overrides of every run here: tiny on the CPU, small on a GPU
RUN_MODEL = {"cpu": ["model.hidden=64", "model.heads=4", "model.layers=4", "model.seq_len=32"],
             "cuda": ["model.hidden=256", "model.heads=8", "model.layers=4", "model.seq_len=256"]}


def tokens_file(tmp: Path) -> Path:
    """A local token file (no tokenizer training, nothing downloaded), made once per ``tmp``."""
    path = tmp / "tokens.npy"
    if not path.exists():
        tmp.mkdir(parents=True, exist_ok=True)
        np.save(path, np.random.default_rng(0).integers(0, VOCAB, size=200_000).astype(np.uint16))
    return path


def run_config(tmp: Path, device: str, name: str, overrides: list[str]):
    """``tiny-cpu`` shrunk for ``device``: global batch 4, fp32, no eval, no periodic checkpoints,
    its own dirs under ``tmp/name``; ``overrides`` last."""
    base = [f"data.source={tokens_file(tmp)}", "parallel.tp=1", "train.global_batch=4", "train.micro_batch=4",
            "train.precision=fp32", "train.eval_interval=0", "train.log_interval=1000", "train.warmup_steps=2",
            "train.steps=4", "checkpoint.interval=0", "checkpoint.resume=never",
            f"checkpoint.dir={tmp / name / 'ckpt'}", f"out_dir={tmp / name / 'out'}"]
    return load_run_config("tiny-cpu", base + RUN_MODEL[device] + overrides)


def train_losses(cfg, mesh: ParallelMesh, steps: int | None = None) -> list[float]:
    """The losses of the first ``steps`` optimizer steps (default ``train.steps``) of a Trainer."""
    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's banner and resolved config
        trainer = Trainer(cfg, mesh=mesh)
        try:
            return [trainer.train_step(s).loss for s in range(steps or cfg.train.steps)]
        finally:
            trainer.close()


def quiet_fit(cfg, mesh: ParallelMesh) -> tuple[dict, str]:
    """``Trainer(cfg, mesh).fit()`` with its printing captured: (history, printed text)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = Trainer(cfg, mesh=mesh).fit()
    return history, out.getvalue()


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b)) if len(a) == len(b) else float("inf")


# ---------------------------------------------------------------------------------- resume
def check_resume(device: str, tmp: Path) -> list:
    """12 steps with dropout, checkpointed at 10; resuming at 10 must give steps 11-12 bit for bit.
    On CUDA the same checkpoint is also resumed on the CPU (other generators: reseeded, logged)."""
    mesh = ParallelMesh.single(device)
    drop = ["model.dropout=0.1", "model.attention_dropout=0.1", "train.steps=12", "checkpoint.interval=10",
            "checkpoint.keep=3", "train.precision=auto"]
    whole, _ = quiet_fit(run_config(tmp, device, "resume", drop), mesh)
    ckpt = tmp / "resume" / "ckpt"
    folders = sorted((p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step_")),
                     key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    if len(folders) != 2:
        return [Row("resume at 10: steps 11-12 vs uninterrupted", f"checkpoints {[p.name for p in folders]}",
                     "two (steps 10, 12)", "FAIL")]
    shutil.rmtree(folders[-1])  # the step-12 checkpoint: the resume starts at 10
    (ckpt / "latest").unlink(missing_ok=True)
    again = tmp / "resume-again"
    shutil.copytree(ckpt, again / "ckpt")  # a pristine copy for the device-change resume
    resumed, text = quiet_fit(run_config(tmp, device, "resume", drop + ["checkpoint.resume=auto"]), mesh)
    same = resumed["steps"] == [11, 12] and resumed["losses"] == whole["losses"][10:12]
    rows = [Row("resume at 10 (dropout 0.1): steps 11-12 vs uninterrupted run",
                 f"steps {resumed['steps']}, losses {resumed['losses']} vs {whole['losses'][10:12]}",
                 "bit-identical", verdict(same))]
    if device != "cuda":
        return rows + [Row("resume a CUDA checkpoint on the CPU", NEEDS_CUDA, "runs, logs once", "SKIP")]
    cpu_cfg = run_config(tmp, "cuda", "resume-again", drop + ["checkpoint.resume=auto"])
    moved, text = quiet_fit(cpu_cfg, ParallelMesh.single("cpu"))
    said = text.count("saved on cuda are restored on cpu")  # a line of the run's log, not a warning
    ok = moved["steps"] == [11, 12] and all(abs(x) < 1e4 for x in moved["losses"]) and said >= 1
    return rows + [Row("resume a CUDA checkpoint on the CPU", f"steps {moved['steps']}, losses "
                        f"{[round(x, 4) for x in moved['losses']]}, {said} device-change line(s) in the log",
                        "steps [11, 12], finite, logged", verdict(ok))]


# ---------------------------------------------------------------------------------- precision
def check_bf16_autocast(device: str, tmp: Path) -> list:
    """bf16-autocast's losses against fp32's over 6 steps (same seed, data, layout)."""
    mesh = ParallelMesh.single(device)
    ref = train_losses(run_config(tmp, device, "fp32", ["train.steps=6"]), mesh)
    amp = train_losses(run_config(tmp, device, "amp", ["train.steps=6", "train.precision=bf16-autocast"]), mesh)
    err = max_rel(amp, ref)
    return [Row("bf16-autocast vs fp32: 6 steps, max loss rel diff", f"{err:.2e}", "< 2e-02",
                 verdict(err < 2e-2))]


# ---------------------------------------------------------------------------------- host syncs, memory lines
def check_host_syncs(device: str, tmp: Path) -> list:
    """Host syncs in a step that logs nothing, counted by ``torch.cuda.set_sync_debug_mode("warn")``.
    The step has one by design (``Trainer.agree``'s read of loss, stop flag and grad norm), so
    ``"error"`` mode would stop at it: the count is asserted instead."""
    if device != "cuda":
        return [Row("host syncs in a non-logging step", NEEDS_CUDA, "<= 1", "SKIP")]
    trainer = Trainer(run_config(tmp, device, "syncs", []), mesh=ParallelMesh.single(device))
    try:
        trainer.train_step(0)  # warm: allocations, autotuning, the first step's measurements
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(1)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        trainer.close()
    syncs = host_syncs([str(w.message) for w in seen])
    return [Row("host syncs in a non-logging step (sync debug mode)", f"{len(syncs)} {syncs[:3]}", "<= 1",
                 verdict(len(syncs) <= 1))]


def check_memory_lines(device: str, tmp: Path) -> list:
    """The Trainer's own lines: activations and state after the first step; on CUDA the peak
    memory line at each logging step, within the device's memory."""
    cfg = run_config(tmp, device, "lines", ["train.steps=2", "train.log_interval=1"])
    _, text = quiet_fit(cfg, ParallelMesh.single(device))
    first = [line.strip() for line in text.splitlines() if line.strip().startswith(("activations:", "state:"))]
    rows = [Row("trainer prints its activation and state lines", f"{len(first)} lines: {first[:1]}", "2",
                 verdict(len(first) == 2))]
    if device != "cuda":
        return rows + [Row("trainer memory line per logging step", NEEDS_CUDA, "2 lines", "SKIP")]
    peaks = [float(x) for x in re.findall(r"memory: ([0-9.]+) GiB peak", text)]
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    ok = len(peaks) == 2 and all(0 < p <= total for p in peaks)
    return rows + [Row("trainer memory line per logging step", f"{peaks} GiB of {total:.0f}", "2 lines in (0, total]",
                        verdict(ok))]


# ---------------------------------------------------------------------------------- async checkpoints
def check_async_save(device: str, tmp: Path) -> list:
    """``save_checkpoint(async_save=True)`` returns in < 25% of a synchronous save's time (medians of
    2) for a GPT of 8 layers, h=1024 with its AdamW state on CUDA; on the CPU a tiny model runs the
    same path, its ratio shown but not asserted."""
    on_gpu = device == "cuda"
    shape = (dict(vocab_size=50304, seq_len=1024, hidden=1024, heads=16, layers=8) if on_gpu else
             dict(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2))
    model = GPT(GPTConfig(**shape), ParallelMesh.single(device))
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = torch.randint(0, shape["vocab_size"], (1, shape["seq_len"]), device=device)
    model(tokens, tokens).backward()
    opt.step()  # AdamW moments exist: the checkpoint holds them
    times: dict[str, list[float]] = {"sync": [], "async": []}
    for i in range(5):  # a warm-up save first (planning caches, file creation), then alternating
        kind = "async" if i % 2 else "sync"
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = save_checkpoint(tmp / f"save-{kind}", i + 1, [model], opt, {}, "", [model.rng], keep=1,
                              async_save=kind == "async")
        if i > 0:
            times[kind].append(time.perf_counter() - t0)
        if kind == "async":
            out.finish()
    ratio = statistics.median(times["async"]) / statistics.median(times["sync"])
    what = "GPT 8L h=1024 + AdamW" if on_gpu else "tiny CPU model: shown, asserted on CUDA only"
    return [Row(f"async save() returns / sync save ({what})",
                f"{statistics.median(times['async']):.3f} s / {statistics.median(times['sync']):.3f} s = {ratio:.3f}",
                "< 0.25", verdict(ratio < 0.25) if on_gpu else "INFO")]


# ---------------------------------------------------------------------------------- sdpa replay
_ATTENTION_NAME = re.compile(r"scaled_dot_product|flash|fmha|efficient_attention|cudnn.*(attention|sdpa)|sdpa", re.I)


def _attention_kernels(prof) -> list[str]:
    return sorted({e.name for e in prof.events() if _ATTENTION_NAME.search(e.name)})


def check_sdpa_replay(device: str, tmp: Path) -> list:
    """sdpa with attention dropout under selective recompute: gradients bit-identical to no
    recompute, and the replay runs the first pass's attention kernel (torch.profiler names)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    dtype = "bfloat16" if device == "cuda" else "float32"
    shape = (dict(vocab_size=512, seq_len=256, hidden=512, heads=8, layers=2) if device == "cuda" else
             dict(vocab_size=128, seq_len=32, hidden=32, heads=4, layers=2))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape["vocab_size"], (2, shape["seq_len"]), generator=g).to(device)
    rows = []
    for p in (0.1, 0.125):  # 0.125: a multiple of 1/16, which cuDNN attention's dropout needs
        grads, names = [], {}
        for mode in ("none", "selective"):
            cfg = GPTConfig(**shape, attention="sdpa", dropout=0.1, attention_dropout=p, recompute=mode, dtype=dtype)
            model = GPT(cfg, ParallelMesh.single(device), seed=0)
            with profile(activities=activities) as fwd:
                loss = model(tokens, tokens)
            with profile(activities=activities) as bwd:
                loss.backward()
            grads.append({n: q.grad for n, q in model.named_parameters()})
            names[mode] = (_attention_kernels(fwd), _attention_kernels(bwd))
        same = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
        fwd_names, replay_names = names["selective"]
        replayed = bool(fwd_names) and set(fwd_names) <= set(replay_names)
        rows.append(Row(f"sdpa attention dropout {p} under selective recompute vs none",
                         f"{'bit-identical' if same else 'grads differ'}; forward {fwd_names}; "
                         f"replay + backward {replay_names}".replace("|", "/"),
                         "bit-identical, replay runs the forward's kernels", verdict(same and replayed)))
    return rows
