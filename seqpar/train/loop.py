"""The training loop: data -> GPT (TP + SP + recompute) -> DP reduction -> clip -> AdamW.

Order of operations per optimizer step, on every rank:
micro-batches forward/backward (DDP's dp all-reduce only on the last: ``no_sync`` before) ->
SP-replicated grads all-reduced over TP -> TP-aware global-norm clipping -> AdamW step ->
one world all-reduce carrying the loss and the stop flag (NaN check, SIGTERM).
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import flops
from ..config import RunConfig, dump
from ..distributed.grad_sync import sync_sp_replicated_grads
from ..distributed.mesh import ParallelMesh, init_parallel, validate_layout
from ..memory.ledger import ActivationLedger
from ..model import GPT
from . import checkpoint as ckpt
from .data import TokenBatches, eval_batches, open_corpus, prepare_corpus
from .generate import sample
from .metrics import MetricsLogger, device_name
from .optim import build_optimizer, clip_grad_norm_tp, lr_at


class _StopRequest:
    """Remembers a SIGTERM so the loop can checkpoint and exit at the next step boundary."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _load_data(cfg: RunConfig, mesh: ParallelMesh, log):
    kw = dict(vocab_size=cfg.model.vocab_size, cache_dir=cfg.data.cache_dir, max_bytes=cfg.data.max_bytes)
    if mesh.is_first:
        corpus = prepare_corpus(cfg.data.source, log=log, **kw)
    _barrier()
    if not mesh.is_first:
        corpus = open_corpus(cfg.data.source, **kw)
    if corpus.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"the corpus needs vocab_size >= {corpus.vocab_size}, model.vocab_size is "
                         f"{cfg.model.vocab_size}")
    return corpus


def train(cfg: RunConfig, *, mesh: ParallelMesh | None = None) -> dict:
    """Run training as configured; returns ``{"steps", "losses", "eval", "checkpoint"}`` on every rank."""
    cfg.validate()  # every rank, before any collective
    world = mesh.world_size if mesh else _world_size()
    dp = validate_layout(cfg.parallel.tp, cfg.parallel.dp, world)
    accum = cfg.accumulation_steps(dp)
    if mesh is None:
        from datetime import timedelta
        mesh = init_parallel(cfg.parallel.tp, cfg.parallel.dp,
                             timeout=timedelta(minutes=cfg.parallel.timeout_minutes))
    if mesh.device.type == "cpu":
        torch.set_num_threads(cfg.train.threads_per_rank)
    tc, mc = cfg.train, cfg.model
    logger = MetricsLogger(cfg.out_dir, mesh.is_first, tc.steps)
    logger.print(f"seqpar: {mesh}; model {mc.layers}L h={mc.hidden} a={mc.heads} s={mc.seq_len} "
                 f"v={mc.vocab_size}; sequence_parallel={mc.sequence_parallel} recompute={mc.recompute}; "
                 f"micro_batch={tc.micro_batch} x accumulation {accum} x dp {dp}")
    if mesh.is_first:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out_dir) / "config.yaml").write_text(dump(cfg))
        logger.print("resolved config:\n" + "\n".join("  " + line for line in dump(cfg).splitlines()))

    corpus = _load_data(cfg, mesh, logger.print)
    train_tokens, heldout = corpus.split(cfg.data.eval_fraction)
    batches = TokenBatches(train_tokens, seq_len=mc.seq_len, micro_batch=tc.micro_batch, seed=tc.seed,
                           dp_rank=mesh.dp_rank, dp_size=dp)
    evals = (eval_batches(heldout, seq_len=mc.seq_len, micro_batch=tc.micro_batch, num_batches=tc.eval_batches,
                          dp_rank=mesh.dp_rank, dp_size=dp) if tc.eval_interval > 0 and len(heldout) > mc.seq_len
             else [])

    model = GPT(mc, mesh, seed=tc.seed)
    logger.print(f"parameters: {model.num_parameters():,} in the full model, {model.num_parameters(False):,} "
                 f"on this rank")
    optimizer = build_optimizer(model, lr=tc.lr, weight_decay=tc.weight_decay, betas=(tc.beta1, tc.beta2))
    start = 0
    latest = ckpt.latest_checkpoint(cfg.checkpoint.dir) if cfg.checkpoint.resume == "auto" else None
    if latest is not None:
        extra = ckpt.load_checkpoint(latest, model, optimizer, model.rng)
        start = int(extra["step"])
        batches.load_state_dict(extra["data"])
        logger.print(f"resumed from {latest} at step {start}")
    ddp = model
    if dp > 1:
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, process_group=mesh.dp_group, broadcast_buffers=False)

    use_bf16 = tc.autocast == "bf16" or (tc.autocast == "auto" and mesh.device.type == "cuda")
    autocast = (lambda: torch.autocast(mesh.device.type, dtype=torch.bfloat16)) if use_bf16 else contextlib.nullcontext
    tokens_per_step = tc.micro_batch * accum * dp * mc.seq_len
    step_flops = flops.model_flops(B=tc.micro_batch * accum * dp, s=mc.seq_len, h=mc.hidden, L=mc.layers,
                                   v=mc.vocab_size)
    peak = flops.peak_flops(device_name())
    attachments = {}
    if corpus.tokenizer is not None:  # checkpoints carry the tokenizer so `seqpar generate` needs nothing else
        attachments["tokenizer.json"] = Path(cfg.out_dir) / "tokenizer.json"
        if mesh.is_first:
            corpus.tokenizer.save(str(attachments["tokenizer.json"]))
    stop = _StopRequest()
    history = {"steps": [], "losses": [], "eval": [], "checkpoint": None}
    act_bytes, mem_shown = None, False
    window_t = 0.0

    def save(step: int) -> None:
        extra = {"data": batches.state_dict(), "tp": mesh.tp_size, "dp": dp}
        path = ckpt.save_checkpoint(cfg.checkpoint.dir, step, model, optimizer, extra, dump(cfg), model.rng,
                                    keep=cfg.checkpoint.keep, attachments=attachments)
        history["checkpoint"] = str(path)
        logger.print(f"checkpoint saved: {path}")

    try:
        for step in range(start, tc.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), dtype=torch.float64)
            for micro in range(accum):
                tokens, labels = (x.to(mesh.device) for x in next(batches))
                sync = contextlib.nullcontext() if (dp == 1 or micro == accum - 1) else ddp.no_sync()
                measure = ActivationLedger(model) if act_bytes is None and mesh.device.type == "cpu" else None
                with sync:
                    with autocast(), (measure or contextlib.nullcontext()):
                        loss = ddp(tokens, labels)
                    (loss / accum).backward()
                if measure is not None:
                    act_bytes = measure.total()
                loss_sum += loss.detach().double().cpu() / accum
            sync_sp_replicated_grads(model, mesh.tp_group)
            gnorm = clip_grad_norm_tp(model, tc.grad_clip, mesh.tp_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # one all-reduce: mean loss over the world (= over dp; TP replicas agree) and the stop flag
            flag = torch.tensor([loss_sum.item(), float(stop.requested)], dtype=torch.float64)
            if dist.is_initialized():
                dist.all_reduce(flag)
                flag[0] /= dist.get_world_size()
            loss_val, stopping = float(flag[0]), flag[1] > 0
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"non-finite loss ({loss_val}) at step {step + 1}; stopping. Lower "
                                         f"train.lr or check the data; the last checkpoint is kept.")
            done = step + 1
            history["steps"].append(done)
            history["losses"].append(loss_val)
            window_t += time.perf_counter() - t0
            if done % tc.log_interval == 0 or done == tc.steps:
                n = (done - start) % tc.log_interval or min(tc.log_interval, done - start)
                dt = window_t / max(1, n)
                per_dev = step_flops / dt / mesh.world_size
                mem = (f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak" if mesh.device.type == "cuda"
                       else f"{(act_bytes or 0) / 2**20:.1f} MiB saved activations")
                logger.log(done, {"loss": loss_val, "lr": lr, "grad norm": gnorm,
                                  "tokens/s": round(tokens_per_step / dt), "TFLOP/s": per_dev / 1e12,
                                  "MFU": per_dev / peak if peak else None})
                if mesh.device.type == "cuda" or not mem_shown:  # the CPU figure is measured once
                    logger.print(f"           memory: {mem}")
                    mem_shown = True
                window_t = 0.0
            if evals and tc.eval_interval > 0 and (done % tc.eval_interval == 0 or done == tc.steps):
                ev = evaluate(model, evals, autocast)
                history["eval"].append((done, ev))
                logger.print(f"           eval loss {ev:.4f} at step {done}")
            interval = cfg.checkpoint.interval
            if stopping or done == tc.steps or (interval > 0 and done % interval == 0):
                save(done)
            if stopping:
                logger.print(f"SIGTERM received: checkpoint written at step {done}, exiting cleanly")
                break
        if corpus.tokenizer is not None and not stop.requested:
            ids = sample(model, corpus.encode("def "), 48, seed=tc.seed)
            logger.print("sample:\n" + corpus.decode(ids))
    finally:
        stop.restore()
        logger.close()
    return history


@torch.no_grad()
def evaluate(model: GPT, batches, autocast) -> float:
    """Mean held-out loss over ``batches``, averaged over the world (identical on all ranks)."""
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    for tokens, labels in batches:
        with autocast():
            total += model(tokens.to(model.mesh.device), labels.to(model.mesh.device)).double().cpu()
    model.train()
    total /= len(batches)
    if dist.is_initialized():
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return float(total)
