"""Training runs through seqpar's public API (``Trainer``, ``save_checkpoint``): resume bit for
bit and on another device type, bf16-autocast, host syncs per step, the Trainer's memory lines,
asynchronous checkpoints."""
import re
import shutil
import statistics
import time
import warnings

import torch

from gpt_helpers import batch
from seqpar.checkpoint import save_checkpoint
from seqpar.distributed import ParallelMesh
from seqpar.model import GPT, GPTConfig
from seqpar.train import Trainer
from seqpar.train.optim import build_optimizer

from .helpers import host_syncs, max_rel
from .trainer_runs import quiet_fit, run_config, train_losses

# torch's checkpoint notice for one process without a process group: the intent of these runs
DROPOUT_RUN = ["model.dropout=0.1", "model.attention_dropout=0.1", "train.steps=12", "checkpoint.interval=10",
               "checkpoint.keep=3", "train.precision=auto"]


def test_resume(device, shapes, record_row, tmp_path):
    """12 steps with dropout, checkpointed at 10: resuming at 10 gives steps 11-12 bit for bit. On
    CUDA the same checkpoint also resumes on the CPU (other generators: reseeded, said in the log)."""
    mesh = ParallelMesh.single(device)
    whole, _ = quiet_fit(run_config(tmp_path, shapes, "resume", DROPOUT_RUN), mesh)
    ckpt = tmp_path / "resume" / "ckpt"
    folders = sorted((p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step_")),
                     key=lambda p: int(re.sub(r"\D", "", p.name) or 0))
    assert len(folders) == 2, f"checkpoints {[p.name for p in folders]}, expected two (steps 10, 12)"
    shutil.rmtree(folders[-1])  # the step-12 checkpoint: the resume starts at 10
    (ckpt / "latest").unlink(missing_ok=True)
    shutil.copytree(ckpt, tmp_path / "resume-again" / "ckpt")  # a pristine copy for the device-change resume
    resumed, _ = quiet_fit(run_config(tmp_path, shapes, "resume", DROPOUT_RUN + ["checkpoint.resume=auto"]), mesh)
    record_row("resume at 10 (dropout 0.1): steps 11-12 vs uninterrupted run",
               f"steps {resumed['steps']}, losses {resumed['losses']} vs {whole['losses'][10:12]}", "bit-identical",
               resumed["steps"] == [11, 12] and resumed["losses"] == whole["losses"][10:12])
    if device != "cuda":
        return
    cpu_cfg = run_config(tmp_path, shapes, "resume-again", DROPOUT_RUN + ["checkpoint.resume=auto"])
    moved, text = quiet_fit(cpu_cfg, ParallelMesh.single("cpu"))
    said = text.count("saved on cuda are restored on cpu")  # a line of the run's log, not a warning
    record_row("resume a CUDA checkpoint on the CPU", f"steps {moved['steps']}, losses "
               f"{[round(x, 4) for x in moved['losses']]}, {said} device-change line(s) in the log",
               "steps [11, 12], finite, logged",
               moved["steps"] == [11, 12] and all(abs(x) < 1e4 for x in moved["losses"]) and said >= 1)


def test_precision(device, shapes, record_row, tmp_path):
    """bf16-autocast's losses within 2% of fp32's over 6 steps (same seed, data, layout)."""
    mesh = ParallelMesh.single(device)
    ref = train_losses(run_config(tmp_path, shapes, "fp32", ["train.steps=6"]), mesh)
    amp = train_losses(run_config(tmp_path, shapes, "amp", ["train.steps=6", "train.precision=bf16-autocast"]), mesh)
    err = max_rel(amp, ref)
    record_row("bf16-autocast vs fp32: 6 steps, max loss rel diff", f"{err:.2e}", "< 2e-02", err < 2e-2)


def test_syncs(cuda, shapes, record_row, tmp_path):
    """Host syncs of a step that logs nothing, counted under ``torch.cuda.set_sync_debug_mode("warn")``:
    none is expected (fused AdamW skips a non-finite step on the device; the flags are read at the
    next logging step), at most the wait for the previous step's stop flag
    (:class:`seqpar.train.deferred.StopMailbox`), so the count is asserted rather than using
    ``"error"`` mode."""
    trainer = Trainer(run_config(tmp_path, shapes, "syncs", []), mesh=ParallelMesh.single(cuda))
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
    record_row("host syncs in a non-logging step (sync debug mode)", f"{len(syncs)} {syncs[:3]}", "<= 1",
               len(syncs) <= 1)


def test_trainer_step_time(device, shapes, record_row, tmp_path):
    """The Trainer's real step (data, the run's precision, clip, flags, AdamW; ``train.precision=auto``:
    the bf16 recipe on CUDA), median over steps that do not log, next to its tokens/s: shown."""
    cfg = run_config(tmp_path, shapes, "step-time", ["train.steps=8", "train.precision=auto"])
    trainer = Trainer(cfg, mesh=ParallelMesh.single(device))
    times = []
    try:
        for step in range(cfg.train.steps - 1):  # the last step reads and logs: not timed
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.train_step(step)
            if device == "cuda":
                torch.cuda.synchronize()
            if step >= 2:  # the first steps measure activations and state, and warm up
                times.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    step_s = statistics.median(times)
    tokens = cfg.train.global_batch * cfg.model.seq_len
    record_row(f"Trainer step ({trainer.precision.name}, {type(trainer.optimizer).__name__} "
               f"fused={bool(trainer.optimizer.defaults.get('fused'))}), median of {len(times)} non-logging steps",
               f"{step_s * 1e3:.2f} ms/step, {tokens / step_s:,.0f} tokens/s", "-", None)


def test_host_sync_count_ignores_the_debug_modes_own_notice():
    """Under set_sync_debug_mode("warn") torch first warns that the mode is a prototype; that notice
    mentions synchronization but is no sync (the H200 run counted it: 2 where one step has 1)."""
    notice = "Synchronization debug mode is a prototype feature and does not yet detect all synchronizing operations"
    sync = "called a synchronizing CUDA operation (Triggered internally at /pytorch/c10/cuda/CUDAFunctions.cpp:163.)"
    assert host_syncs([notice, sync]) == [sync[:80]]
    assert host_syncs([notice]) == []


def test_lines(device, shapes, record_row, tmp_path):
    """The Trainer's own lines: activations and state after the first step; on CUDA the peak-memory
    line at each logging step, within the device's memory."""
    cfg = run_config(tmp_path, shapes, "lines", ["train.steps=2", "train.log_interval=1"])
    _, text = quiet_fit(cfg, ParallelMesh.single(device))
    first = [line.strip() for line in text.splitlines() if line.strip().startswith(("activations:", "state:"))]
    record_row("trainer prints its activation and state lines", f"{len(first)} lines: {first[:1]}", "2",
               len(first) == 2)
    if device == "cuda":
        peaks = [float(x) for x in re.findall(r"memory: ([0-9.]+) GiB peak", text)]
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        record_row("trainer memory line per logging step", f"{peaks} GiB of {total:.0f}", "2 lines in (0, total]",
                   len(peaks) == 2 and all(0 < p <= total for p in peaks))


def test_async(device, record_row, tmp_path):
    """``save_checkpoint(async_save=True)`` returns in < 25% of a synchronous save's time (medians of
    2) for a GPT of 8 layers, h=1024 with its AdamW state on CUDA; on the CPU a tiny model runs the
    same path, its ratio shown, not asserted."""
    on_gpu = device == "cuda"
    cfg = GPTConfig(**(dict(vocab_size=50304, seq_len=1024, hidden=1024, heads=16, layers=8) if on_gpu else
                       dict(vocab_size=256, seq_len=32, hidden=64, heads=4, layers=2)))
    model = GPT(cfg, ParallelMesh.single(device))
    opt = build_optimizer(model, lr=1e-4, weight_decay=0.1, betas=(0.9, 0.95))
    tokens = batch(cfg, 1)[0].to(device)
    model(tokens, tokens).backward()
    opt.step()  # AdamW moments exist: the checkpoint holds them
    times: dict[str, list[float]] = {"sync": [], "async": []}
    for i in range(5):  # a warm-up save first (planning caches, file creation), then alternating
        kind = "async" if i % 2 else "sync"
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = save_checkpoint(tmp_path / f"save-{kind}", i + 1, [model], opt, {}, "", [model.rng], keep=1,
                              async_save=kind == "async")
        if i > 0:
            times[kind].append(time.perf_counter() - t0)
        if kind == "async":
            out.finish()
    ratio = statistics.median(times["async"]) / statistics.median(times["sync"])
    what = "GPT 8L h=1024 + AdamW" if on_gpu else "tiny CPU model: shown, asserted on CUDA only"
    record_row(f"async save() returns / sync save ({what})",
               f"{statistics.median(times['async']):.3f} s / {statistics.median(times['sync']):.3f} s = {ratio:.3f}",
               "< 0.25", ratio < 0.25 if on_gpu else None)
