"""The Trainer: data -> GPT (TP + SP + recompute) -> dp reduction -> clip -> AdamW, one method per job.

Setup (``Trainer(cfg)``), in order: the run resolved by :func:`seqpar.train.resolve.resolve_run`
(validated on every rank before any collective; pipeline batch split, accumulation, ddp/fsdp,
``recompute: auto``, a resumed checkpoint's global batch) -> mesh -> header and resolved config
-> corpus (every rank prepares it; a file lock, not a collective, makes the others wait while one
builds the cache), training and eval batches -> the step engine (:mod:`seqpar.parallel.engine`: the GPT over FSDP2 or DDP on dp,
or this rank's pipeline stages) -> optimizer -> checkpoint manager. :meth:`Trainer.fit` then
resumes and runs the loop.

Order of operations per optimizer step (:meth:`Trainer.train_step`), on every rank:
set the step's learning rate -> the step's micro-batches, cut from its global batch (a function of
seed and step only) -> :func:`seqpar.train.step.run_step`, the one step function (the tools run it
too): the engine's forward/backward, the global-norm clip, one world all-reduce carrying the mean
loss, the stop flag and whether the grad norm is finite, the AdamW step (skipped on the device
under fused AdamW when the loss or the gradients are not finite) -> on a step that reads its flags
(every step under foreach AdamW, the CPU default; under fused AdamW only a logging, evaluation,
checkpoint or last step, :mod:`seqpar.train.deferred`), for each step since the last read: a stop
naming a non-finite step or a skipped step (``train.nonfinite_grads``, ``max_skipped_steps``)
-> grads zeroed. After the step,
:meth:`Trainer.fit` logs, evaluates and checkpoints on their intervals (never NaN/inf weights nor
right after a skipped step), and stops cleanly after a checkpoint when any rank received SIGTERM.
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import torch

from .. import flops
from ..checkpoint import data_identity, open_checkpoint_dir
from ..config import RunConfig, dump
from ..data import Batch, load_corpus, run_batches, tokenizer_attachment
from ..distributed.collectives import all_reduce, group_size, world_group
from ..distributed.mesh import ParallelMesh, init_parallel
from ..parallel.data_parallel import state_bytes, state_line
from ..parallel.compile import compile_seconds
from ..parallel.engine import build_engine
from ..parallel.precision import Precision
from .checkpointing import CheckpointManager, resume_global_batch
from .deferred import StepMetrics, StopMailbox, reads_at
from .faults import NonFiniteError, SkippedSteps, StopRequest, nonfinite_error, nonfinite_what
from .generate import sample as sample_ids
from .metrics import MetricsLogger, Throughput, device_name
from .optim import build_optimizer, lr_at
from .preflight import check_memory
from .resolve import ResolvedRun, check_mesh, check_trainer_arguments, resolve_run
from .step import Halt, StepResult, agree, read_results, run_step


def _world_size() -> int:
    world = world_group()
    return group_size(world) if world is not None else int(os.environ.get("WORLD_SIZE", "1"))


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class Trainer:
    """Trains ``cfg.model`` on ``cfg.data`` as configured. Build it on every rank (it validates the
    config before any collective), then call :meth:`fit`; the other methods are its steps.
    ``cfg``: a :class:`RunConfig`, or a run already resolved by :func:`resolve_run`."""

    def __init__(self, cfg: RunConfig | ResolvedRun, *, mesh: ParallelMesh | None = None):
        check_trainer_arguments(cfg, mesh)
        world = mesh.world_size if mesh else _world_size()
        device = mesh.device.type if mesh else _default_device()
        self.run = cfg if isinstance(cfg, ResolvedRun) else resolve_run(
            cfg, world, device, saved_global_batch=resume_global_batch(cfg))
        if self.run.world_size != world:
            raise ValueError(f"the run was resolved for world size {self.run.world_size}, got {world}")
        check_mesh(self.run, mesh)
        check_memory(self.run, mesh.device if mesh else device, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        cfg = self.run.cfg
        self.mesh = self._setup_mesh(mesh)
        self.logger = MetricsLogger(cfg.out_dir, self.mesh.is_first, cfg.train.steps)
        self.history: dict = {"steps": [], "losses": [], "eval": [], "checkpoint": None, "skipped": []}
        self.start_step = 0  # first step this process runs (> 0 after a resume)
        self.state: dict[str, int] | None = None  # bytes of training state, measured at the first step
        self._stop: StopRequest | None = None  # installed by fit()
        self.skips = SkippedSteps(cfg.train.max_skipped_steps)  # train.nonfinite_grads=skip's streaks
        self._ahead: tuple[int, list[Batch]] | None = None  # the next step's batches, on their way (CUDA)
        self._unread: list[tuple[int, StepResult]] = []  # steps whose flags are still on the device
        self._halt = Halt()  # train.nonfinite_grads=stop with device skips: no update after a bad step
        self._ckpt_dir = None  # the job's lock on checkpoint.dir (rank 0), held until close()
        try:
            self._ckpt_dir = open_checkpoint_dir(cfg.checkpoint.dir, self.mesh.is_first, out_dir=cfg.out_dir)
            self._announce()
            self._setup_data()
            self.precision = Precision(cfg.train.precision, self.mesh.device, fsdp=self.run.dp_mode == "fsdp")
            self._setup_model()
            self.throughput = self._throughput()
            self._mailbox = StopMailbox(self.mesh.device)
        except BaseException:
            self.logger.close()
            if self._ckpt_dir is not None:
                self._ckpt_dir.close()
            raise

    # ---- setup -------------------------------------------------------------------------------

    def _setup_mesh(self, mesh: ParallelMesh | None) -> ParallelMesh:
        """The mesh of the resolved layout, unless one was given."""
        pc = self.run.cfg.parallel
        if mesh is None:
            mesh = init_parallel(pc.tp, self.run.dp, pp=pc.pp, cp=pc.cp, timeout=timedelta(minutes=pc.timeout_minutes))
        if mesh.device.type == "cpu":
            torch.set_num_threads(self.run.cfg.train.threads_per_rank)
        return mesh

    def _announce(self) -> None:
        """Print the layout and the resolved config; the first rank writes ``config.yaml``."""
        run, cfg = self.run, self.run.cfg
        mc, tc = cfg.model, cfg.train
        self.logger.print(f"seqpar: {self.mesh}; model {mc.layers}L h={mc.hidden} a={mc.heads} s={mc.seq_len} "
                          f"v={mc.vocab_size}; sequence_parallel={mc.sequence_parallel} recompute={mc.recompute}"
                          f"{''.join('+' + op for op in mc.recompute_ops)}; "
                          f"micro_batch={tc.micro_batch} x accumulation {run.accum} x dp {run.dp}")
        for note in (self.run.recompute_note, self.run.batch_note):
            if note:
                self.logger.print(note)
        if self.mesh.is_first:  # the config in full: the file (and `seqpar train --show-config`)
            Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.out_dir) / "config.yaml").write_text(dump(cfg))
            self.logger.print(f"outputs: checkpoints {cfg.checkpoint.dir}, {self.logger.where}")

    def _setup_data(self) -> None:
        """Corpus, the training batches of this dp rank, fixed eval batches, the tokenizer attachment."""
        run = self.run
        self.corpus = load_corpus(run.cfg, self.logger.print)
        self.batches, self.evals = run_batches(run.cfg, self.corpus, self.mesh.dp_rank, run.dp, run.accum,
                                               self.logger.print)
        self.attachments = tokenizer_attachment(run.cfg, self.corpus, self.mesh.is_first)

    def _setup_model(self) -> None:
        """The step engine (the GPT over ddp / fsdp, or this rank's pipeline stages), its optimizer
        and the checkpoint manager over the engine's model parts."""
        tc = self.run.cfg.train
        self.engine = build_engine(self.run.cfg, self.mesh, accum=self.run.accum, precision=self.precision)
        self.model = self.engine.module  # the GPT, or an nn.ModuleList of this rank's stages
        self.logger.print(self.engine.parameters_line())
        self.precision.check_model(self.model)
        self.optimizer = build_optimizer(self.model, lr=tc.lr, weight_decay=tc.weight_decay,
                                         betas=(tc.beta1, tc.beta2))
        self.checkpoints = CheckpointManager(self.run, module=self.model, parts=self.engine.parts,
                                             streams=self.engine.streams, optimizer=self.optimizer,
                                             batches=self.batches, attachments=self.attachments,
                                             data=data_identity(self.corpus.tokens, self.corpus.tokenizer,
                                                                list(zip(self.corpus.names, self.corpus.weights))),
                                             print=self.logger.print)

    def _throughput(self) -> Throughput:
        """Tokens and model FLOPs per optimizer step (whole world) against the device's peak."""
        run = self.run
        mc, sequences = run.cfg.model, run.global_batch
        step_flops = flops.step_model_flops(mc, sequences=sequences, t=self.mesh.tp_size)
        return Throughput(sequences * mc.seq_len, step_flops, self.mesh.world_size, flops.peak_flops(device_name()))

    # ---- one optimizer step --------------------------------------------------------------------

    def set_lr(self, step: int) -> float:
        """Warmup + cosine learning rate of ``step`` (from 0), written into every param group."""
        tc = self.run.cfg.train
        lr = lr_at(step, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def micro_batches(self, step: int) -> list[Batch]:
        """The ``accum`` micro-batches of optimizer step ``step`` on this dp rank, on the mesh device:
        this rank's share of the step's global batch, which depends only on seed and step. Their
        ids come from a corpus range-checked when opened, so no per-batch vocabulary check (a
        host sync on GPUs) is needed. On CUDA they were copied from pinned memory without
        blocking, one step ahead (:meth:`prefetch`)."""
        self.batches.step = step + 1  # the data position checkpoints record
        ahead, self._ahead = self._ahead, None
        return ahead[1] if ahead is not None and ahead[0] == step else self._to_device(step)

    def prefetch(self, step: int) -> None:
        """Start copying step ``step``'s micro-batches to the GPU (CUDA only; a no-op elsewhere)."""
        if self.mesh.device.type == "cuda" and step < self.run.cfg.train.steps:
            self._ahead = (step, self._to_device(step))

    def _to_device(self, step: int) -> list[Batch]:
        device = self.mesh.device
        if device.type != "cuda":
            return [(x.to(device), y.to(device)) for x, y in self.batches.step_batches(step)]
        return [(x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True))
                for x, y in self.batches.step_batches(step)]

    def _is_log_step(self, done: int) -> bool:
        tc = self.run.cfg.train
        return done % tc.log_interval == 0 or done == tc.steps

    def agree(self, loss_sum: torch.Tensor, stop: bool, grad_norm: torch.Tensor | None = None
              ) -> tuple[float, bool, bool, float]:
        """The step's one world all-reduce and host read (:func:`seqpar.train.step.agree`):
        ``(loss, stop, finite, grad_norm)``, identical on all ranks."""
        return agree(loss_sum, stop, grad_norm)

    @property
    def stop_requested(self) -> bool:
        """True once this rank received SIGTERM during :meth:`fit`."""
        return self._stop is not None and self._stop.requested

    def train_step(self, step: int) -> StepMetrics:
        """Run optimizer step ``step`` (from 0); a collective on every rank. When the mean loss or
        the gradients are not finite (on any rank) the optimizer step is not taken: under
        ``train.nonfinite_grads=stop`` (default) :class:`NonFiniteError` names the step, under
        ``skip`` the grads are dropped and the step counted in ``history["skipped"]`` (too many in
        a row: :class:`NonFiniteError`, :class:`SkippedSteps`). Under fused AdamW (CUDA) a step
        that neither logs, evaluates nor checkpoints reads nothing from the device: the error or
        the count comes at the next step that does (:mod:`seqpar.train.deferred`); a step after
        a non-finite one under ``stop`` does not update the weights either."""
        tc = self.run.cfg.train
        lr = self.set_lr(step)
        result = run_step(self.engine, self.optimizer, self.micro_batches(step), grad_clip=tc.grad_clip,
                          stop=self.stop_requested, timed=self._is_log_step(step + 1),
                          between=lambda: self.prefetch(step + 1),  # the next step's copies under this one's tail
                          halt=self._halt if tc.nonfinite_grads == "stop" else None)
        stop = self._mailbox.take()  # the previous unread step's stop flag, once this step is queued
        self._unread.append((step, result))
        if result.resolved or stop or reads_at(self.run.cfg, step + 1):
            self.read_steps()
            stop = stop or result.stop
        else:
            self._mailbox.post(result)
        if self.state is None:  # after the first step, when AdamW has its moments
            self.state = state_bytes(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return StepMetrics(lr, result, stop)

    def read_steps(self) -> None:
        """Read the flags of the steps not read yet (one host read) and act on them in order: a
        non-finite step stops the run (:class:`NonFiniteError`) or is counted as skipped."""
        unread, self._unread = self._unread, []
        read_results([r for _, r in unread])
        for step, result in unread:
            if not result.skipped:
                self.skips.take()
                continue
            loss, grad_norm = result.loss, result.grad_norm
            if self.run.cfg.train.nonfinite_grads == "stop":
                self._halt = Halt()
                self.optimizer.zero_grad(set_to_none=True)
                raise nonfinite_error(step, loss, grad_norm, self.checkpoints.good)
            what = nonfinite_what(loss, grad_norm)
            self.history["skipped"].append(step + 1)
            self.logger.print(f"step {step + 1}: {what}; optimizer step skipped "
                              f"({len(self.history['skipped'])} so far, train.nonfinite_grads=skip)")
            self.optimizer.zero_grad(set_to_none=True)
            self.skips.skip(step + 1, what, self.checkpoints.good)  # past train.max_skipped_steps: stop

    # ---- evaluation, checkpoints, samples ------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over the eval batches, averaged over the world (identical on all ranks)."""
        if not self.evals:
            cfg = self.run.cfg
            raise ValueError(f"no eval batches: train.eval_interval is {cfg.train.eval_interval} or the held-out "
                             f"split (data.eval_fraction={cfg.data.eval_fraction}) is shorter than "
                             f"seq_len + 1 = {cfg.model.seq_len + 1} tokens")
        total = self.engine.evaluate(self.evals)
        world = world_group()
        all_reduce(total, world)
        return float(total / group_size(world))

    def sample(self, prompt: str | None = None, max_new_tokens: int | None = None) -> str:
        """Text continuing ``prompt`` (default: ``train.sample_prompt``, else a document's opening from
        the held-out data) by ``max_new_tokens`` (default: ``train.sample_tokens``), seeded by
        ``train.seed``; a collective under TP, call on every rank."""
        if self.corpus.tokenizer is None:
            raise ValueError(f"sample: the corpus {self.run.cfg.data.source!r} is a bare token file without a "
                             f"tokenizer.json beside it")
        if self.engine.full_model is None:
            raise ValueError("sample: this rank holds pipeline stages or context-parallel chunks, not the whole "
                             "model; sample from a checkpoint with seqpar generate")
        try:
            prompt = prompt if prompt is not None else self.run.cfg.train.sample_prompt or self.corpus.opening()
            new = self.run.cfg.train.sample_tokens if max_new_tokens is None else max_new_tokens
            ids = sample_ids(self.engine.full_model, self.corpus.encode(prompt), new, seed=self.run.cfg.train.seed)
        finally:
            self.engine.after_forward_only()
        return self.corpus.decode(ids)

    # ---- the loop ------------------------------------------------------------------------------

    def log_step(self, done: int, m: StepMetrics, seconds: float) -> None:
        """Count the step's ``seconds``; on log steps print one line with the mean throughput since
        the last line, and the memory line (every time on CUDA, once on CPU)."""
        self.throughput.add(seconds)
        if not self._is_log_step(done):
            return
        skipped = {"skipped steps": len(self.history["skipped"])} if self.history["skipped"] else {}
        self.logger.log(done, {"loss": m.loss, "lr": m.lr, "grad norm": m.grad_norm, **skipped,
                               **self.throughput.report()})
        if self.mesh.device.type == "cuda":
            self.logger.print(f"           memory: {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak")
        for line in self.engine.log_lines():
            self.logger.print(line)

    def _after_step(self, done: int, m: StepMetrics) -> None:
        """Evaluate and checkpoint when due (a stop request forces a checkpoint; not after a skipped step)."""
        tc, interval = self.run.cfg.train, self.run.cfg.checkpoint.interval
        if self.evals and tc.eval_interval > 0 and (done % tc.eval_interval == 0 or done == tc.steps):
            ev = self.evaluate()
            self.history["eval"].append((done, ev))
            self.logger.record(done, {"eval loss": ev})
            self.logger.print(f"           eval loss {ev:.4f} at step {done}")
        due = m.stop or done == tc.steps or (interval > 0 and done % interval == 0)
        if due and m.skipped:
            self.logger.print(f"checkpoint of step {done} not written: the step was skipped (non-finite loss or "
                              f"gradients); the last good checkpoint is {self.checkpoints.good or 'none'}")
        elif due:  # the last good checkpoint when no step was skipped since the previous one
            self.history["checkpoint"] = str(self.checkpoints.save(done, good=self.skips.checkpointed()))

    def fit(self) -> dict:
        """Resume if configured, train to ``train.steps`` (or a SIGTERM), then print a sample when
        the corpus has a tokenizer. Returns ``{"steps", "losses", "eval", "checkpoint", "skipped"}``."""
        stopped = False
        try:
            self.start_step = self.checkpoints.resume() or 0
            self._stop = StopRequest()
            compile_start = compile_seconds()
            unlogged: list[StepMetrics] = []  # their losses join history once read (no host read here)
            for step in range(self.start_step, self.run.cfg.train.steps):
                t0 = time.perf_counter()
                m = self.train_step(step)
                self.history["steps"].append(step + 1)
                unlogged.append(m)
                if m.resolved:
                    self.history["losses"].extend(u.loss for u in unlogged)
                    unlogged = []
                if step == self.start_step:  # measured during this first step; printed once
                    compiled = self.engine.compile_line(compile_seconds() - compile_start)
                    if compiled:
                        self.logger.print(compiled)
                    self.logger.print(self.engine.memory_line())
                    self.logger.print(state_line(self.state))
                self.log_step(step + 1, m, time.perf_counter() - t0)
                self._after_step(step + 1, m)
                if m.stop:
                    saved = "no checkpoint" if m.skipped else "checkpoint"  # none after a skipped step
                    self.logger.print(f"{self._stop.name or 'SIGTERM'} received: {saved} written at step {step + 1}, "
                                      f"exiting cleanly")
                    stopped = True
                    break
            whole, asked = self.engine.full_model is not None, self.run.cfg.train.sample_tokens > 0
            if asked and whole and self.corpus.tokenizer is not None and not stopped:
                self._print_sample()
            elif asked and not whole and self.history["checkpoint"]:
                self.logger.print(f"sample: seqpar generate {self.run.cfg.checkpoint.dir} (one process, any layout)")
        finally:
            self.close()
        return self.history

    def _print_sample(self) -> None:
        """A finished run's sample; one line instead after a skipped step or with NaN/inf logits."""
        try:
            if self.skips.streak:
                raise NonFiniteError(f"step {self.skips.streak[-1]} was skipped (non-finite loss or gradients)")
            self.logger.print("sample:\n" + self.sample())
        except NonFiniteError as e:
            self.logger.print(f"sample: not printed, {e}")

    def close(self) -> None:
        """Seal a background checkpoint, restore the SIGTERM handler, close the metrics files,
        release the checkpoint dir."""
        self.checkpoints.finish_pending()
        if self._stop is not None:
            self._stop.restore()
            self._stop = None
        self.logger.close()
        self._ckpt_dir.close()


def train(cfg: RunConfig, *, mesh: ParallelMesh | None = None) -> dict:
    """Run training as configured; returns ``{"steps", "losses", "eval", "checkpoint", "skipped"}`` on
    every rank."""
    return Trainer(cfg, mesh=mesh).fit()
