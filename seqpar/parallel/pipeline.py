"""Pipeline parallelism over ``pp`` on ``torch.distributed.pipelining``, with TP+SP inside stages.

:class:`PipelineParallel` cuts the GPT into ``p * m`` stages (:mod:`.stages`), wraps this rank's
``m`` in ``PipelineStage`` objects over ``mesh.pp_group`` and runs one optimizer step's
micro-batches through a schedule: ``1F1B`` (m = 1), ``Interleaved1F1B`` (m >= 1) or ``GPipe``
(m = 1). Each micro-batch's loss is scaled by ``1/n`` so the gradients are the mean over the
``n`` micro-batches. After the schedule, per step and once each: SP-replicated gradients summed
over TP, the tied token table's two copies summed over {first, last} stage, and (``reduce_dp``)
all gradients averaged over DP: with context parallelism one reduction over dp x cp that sums the
CP ranks' shares and averages over dp. Under expert parallelism (ep carved from dp x cp inside each
stage) the routed experts' gradients are left out of that reduction and summed over their
expert-data-parallel group instead, divided by dp, by the plain step's own
:class:`~seqpar.parallel.expert_grads.ExpertGrads`.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn as nn

from ..distributed.collectives import all_reduce, all_reduce_coalesced
from ..distributed.grad_sync import sync_sp_replicated_grads
from ..distributed.mesh import ParallelMesh
from ..errors import UserError
from ..model.config import GPTConfig
from .expert_grads import ExpertGrads
from .grads import clip_grad_norm, sum_tied_grads, tied_embedding_group
from .stages import StageModule, build_stage_modules, check_stage_split
from .state import gather_dense, load_stage_dense, stage_dense
from .timing import StageTimer, StepTiming, ideal_bubble, timed_stage_class

ScheduleName = Literal["1F1B", "Interleaved1F1B", "GPipe"]
SCHEDULES: tuple[str, ...] = ("1F1B", "Interleaved1F1B", "GPipe")


def resolve_schedule(schedule: str | None, virtual_stages: int) -> str:
    """``None`` -> "1F1B" for m = 1, "Interleaved1F1B" for m > 1; 1F1B and GPipe need m = 1."""
    if schedule is None:
        return "1F1B" if virtual_stages == 1 else "Interleaved1F1B"
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule must be one of {SCHEDULES}, got {schedule!r}")
    if schedule != "Interleaved1F1B" and virtual_stages != 1:
        raise ValueError(f"pp_schedule={schedule!r} runs one stage per rank; virtual_stages={virtual_stages} "
                         f"needs 'Interleaved1F1B'")
    return schedule


def check_microbatches(n_microbatches: int, pp: int, schedule: str) -> None:
    """1F1B schedules need at least ``p`` micro-batches; the interleaved one a multiple of its rounds."""
    if not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise UserError(f"n_microbatches must be a positive integer, got {n_microbatches!r}")
    if schedule == "1F1B" and n_microbatches < pp:
        raise UserError(f"1F1B needs n_microbatches >= pp: got {n_microbatches} micro-batches for p={pp}")
    rounds = max(1, n_microbatches // pp)
    if schedule == "Interleaved1F1B" and n_microbatches % rounds:
        raise UserError(f"Interleaved1F1B needs n_microbatches ({n_microbatches}) to be a multiple of "
                        f"max(1, n_microbatches // p) = {rounds} (p={pp}); use a multiple of p")


class PipelineParallel:
    """This rank's pipeline stages of a GPT and the schedule that trains them.

    ``parts``: this rank's :class:`StageModule` objects (stage ``pp_rank + j p``); ``module``: an
    ``nn.ModuleList`` of them (build the optimizer from it; its parameter names are
    ``"{j}.{GPT name}"``). :meth:`step` runs forward + backward over the micro-batches of one
    optimizer step and returns the mean loss on every rank. ``activation_dtype``: the dtype of
    the residual stream between stages (default the model's; fp32 under bf16 autocast of fp32
    weights, bf16 when computing on bf16 weight copies). ``time_cuda``: the default of
    :meth:`step`'s ``timed``: synchronize after each CUDA chunk so :attr:`last_timing` (the
    bubble) is real. Leave it off in production; time only the steps that report it.
    """

    def __init__(self, config: GPTConfig, mesh: ParallelMesh, seed: int = 0, *, schedule: str | None = None,
                 virtual_stages: int = 1, n_microbatches: int | None = None,
                 activation_dtype: torch.dtype | None = None, reduce_dp: bool = True, time_cuda: bool = False):
        if mesh.pp_size < 2:
            raise ValueError(f"PipelineParallel needs pp >= 2, got pp={mesh.pp_size}: at pp=1 train the GPT itself")
        self.schedule_name = resolve_schedule(schedule, virtual_stages)
        check_stage_split(config.layers, mesh.pp_size, virtual_stages)
        self.n_microbatches = mesh.pp_size if n_microbatches is None else n_microbatches
        check_microbatches(self.n_microbatches, mesh.pp_size, self.schedule_name)
        if mesh.ep_size > 1 and not reduce_dp:
            raise ValueError(f"reduce_dp=False with ep={mesh.ep_size}: expert gradients are always reduced over "
                             f"their expert-data-parallel group, so the dp reduction cannot be left to the caller")
        self.mesh, self.virtual_stages, self.reduce_dp = mesh, virtual_stages, reduce_dp
        self.parts: list[StageModule] = build_stage_modules(config, mesh, seed, virtual_stages)
        self.module = nn.ModuleList(self.parts)
        self.config = self.parts[0].config
        self.activation_dtype = activation_dtype or self.config.torch_dtype
        self.num_stages = mesh.pp_size * virtual_stages
        self.tied_group = tied_embedding_group(mesh) if self.config.tie_embeddings else None
        self.timer, self.time_cuda = StageTimer(), time_cuda
        self._schedule, self._built_for = None, None

    # ------------------------------------------------------------------ parameters
    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters, each once."""
        return list(self.module.parameters())

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters under the GPT's names (``blocks.5.mlp.fc1.weight``), each once:
        the keys a checkpoint of this rank's stages uses (the tied ``wte.weight`` on both ends)."""
        out, seen = [], set()
        for part in self.parts:
            for name, p in part.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def tied_parameters(self) -> list[nn.Parameter]:
        """The token-table copies this rank holds that another pipeline rank also holds."""
        if self.mesh.pp_size == 1 or not self.config.tie_embeddings:
            return []
        return [p.wte.weight for p in self.parts if p.wte is not None]

    def norm_exclude(self) -> list[nn.Parameter]:
        """Parameters the clip norm must skip on this rank: the last stage's tied copy (the
        first stage counts the token table once)."""
        if self.mesh.pp_size == 1:
            return []
        return [p.wte.weight for p in self.parts if p.holds_tied_copy]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm over pp x dp x tp (tied table once; experts once over dp x cp, on the
        first rank of their edp group), clipping at ``max_norm`` > 0."""
        mesh = self.mesh
        return clip_grad_norm(self.module, max_norm, tp_group=mesh.tp_group, dp_group=mesh.dp_group,
                              pp_group=mesh.pp_group, exclude=self.norm_exclude(), device=mesh.device,
                              experts=ExpertGrads(self.module, mesh).params, expert_dp_group=mesh.edp_group,
                              data_group=mesh.dp_cp_group, split_experts=mesh.ep_size > 1)

    def train(self, mode: bool = True) -> "PipelineParallel":
        self.module.train(mode)
        return self

    # ------------------------------------------------------------------ schedule
    def _example(self, part: StageModule, rows: int, seq: int, output: bool) -> torch.Tensor:
        """A meta tensor with the shape a stage receives (``output=False``) or sends."""
        cfg, t = self.config, self.mesh.tp_size
        if not output and part.is_first:
            return torch.empty((rows, seq), dtype=torch.long, device="meta")
        seq //= self.mesh.cp_size  # what a stage passes on: this CP rank's tokens
        if output and part.is_last:
            shape = (seq, rows, cfg.padded_vocab(t) // t)
        else:
            shape = (seq // t if cfg.sequence_parallel else seq, rows, cfg.hidden)
        return torch.empty(shape, dtype=self.activation_dtype, device="meta", requires_grad=True)

    def _build(self, rows: int, seq: int):
        """Stages and schedule for micro-batches of ``rows`` sequences of ``seq`` tokens."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        TimedStage = timed_stage_class()
        stages = [TimedStage(part, part.index, self.num_stages, self.mesh.device,
                             input_args=self._example(part, rows, seq, output=False),
                             output_args=self._example(part, rows, seq, output=True),
                             group=self.mesh.pp_group, timer=self.timer)
                  for part in self.parts]
        last = next((p for p in self.parts if p.is_last), None)
        n = self.n_microbatches

        def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return last.loss(logits, labels) / n  # the mean over micro-batches, as 1/accum scaling

        kind = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe, "Interleaved1F1B": ScheduleInterleaved1F1B}
        cls = kind[self.schedule_name]
        target = stages if cls is ScheduleInterleaved1F1B else stages[0]
        return cls(target, n, loss_fn=loss_fn, scale_grads=False)

    def _schedule_for(self, tokens: torch.Tensor):
        b, s = tokens.shape
        if b % self.n_microbatches:
            raise ValueError(f"the step's batch of {b} sequences is not divisible into n_microbatches="
                             f"{self.n_microbatches} equal micro-batches")
        key = (b // self.n_microbatches, s)
        if self._built_for != key:
            self._schedule, self._built_for = self._build(*key), key
        return self._schedule

    # ------------------------------------------------------------------ one step
    def _run(self, tokens: torch.Tensor, labels: torch.Tensor, train: bool, timed: bool = False) -> torch.Tensor:
        schedule = self._schedule_for(tokens)
        args = (tokens,) if self.mesh.is_first_stage else ()
        target = labels if self.mesh.is_last_stage else None
        losses: list[torch.Tensor] = []
        cuda = self.mesh.device.type == "cuda"
        self.timer.sync_cuda = timed and cuda
        if self.timer.sync_cuda:  # the step's clock starts on an idle device
            torch.cuda.synchronize(self.mesh.device)
        with self.timer.step(record=timed or not cuda):
            if train:
                schedule.step(*args, target=target, losses=losses, return_outputs=False)
            else:
                schedule.eval(*args, target=target, losses=losses)
        return self._agree_loss(losses)

    def _agree_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean loss (sum of the 1/n-scaled losses) on every pipeline rank, float64."""
        loss = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        for x in losses:
            loss += x.detach().double()
        all_reduce(loss, self.mesh.pp_group)  # zeros elsewhere: a broadcast from the last stage
        return loss

    def step(self, tokens: torch.Tensor, labels: torch.Tensor, finish: bool = True,
             timed: bool | None = None) -> torch.Tensor:
        """Forward + backward of one optimizer step's batch ``tokens``/``labels`` ``[B, s]`` (this dp
        rank's share, identical on TP ranks; each pipeline rank passes it, only the first and last
        stage read it) in ``n_microbatches`` micro-batches; gradients accumulate into ``.grad``
        (zero them before). Then (``finish``) :meth:`finish_grads`; pass ``finish=False`` when the
        grads still move elsewhere first (bf16 copies into fp32 masters) and call it after.
        Returns the mean micro-batch loss as a float64 scalar, identical on every pipeline rank.
        ``timed`` (default ``time_cuda``): on CUDA, synchronize after every chunk so
        :attr:`last_timing` holds this step's kernels' busy time; untimed CUDA steps keep it."""
        loss = self._run(tokens, labels, train=True, timed=self.time_cuda if timed is None else timed)
        if finish:
            self.finish_grads()
        return loss

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean loss of forward-only micro-batches (no grads, no dropout change), on every rank."""
        return self._run(tokens, labels, train=False)

    def finish_grads(self) -> None:
        """SP-replicated grads summed over TP (one coalesced all-reduce for this rank's stages),
        tied copies summed over the first/last pair, then (``reduce_dp``) the mean over DP, in the
        same all-reduce as the sum over cp (each CP rank holds its tokens' share; reduced over cp
        even without ``reduce_dp``); under ep the expert gradients over edp afterwards, divided by
        dp (one order on every rank of a stage)."""
        mesh = self.mesh
        sync_sp_replicated_grads(self.module, mesh.tp_group)
        sum_tied_grads(self.tied_parameters(), self.tied_group)
        group, dp = (mesh.dp_cp_group, mesh.dp_size) if self.reduce_dp else (mesh.cp_group, 1)
        experts = ExpertGrads(self.module, mesh)  # inactive at ep = 1: every gradient is dense
        skip = {id(p) for p in experts.params}
        grads = [p.grad for p in self.parameters() if p.grad is not None and id(p) not in skip]
        all_reduce_coalesced(grads, group, divide_by=dp)
        experts.reduce()

    # ------------------------------------------------------------------ dense state
    def dense_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """This rank's stages' parameters (``grads``: their gradients) in the dense layout under the
        GPT's names. A TP collective."""
        return stage_dense(self.parts, grads)

    def full_dense_state_dict(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """The whole model's dense dict on every rank (TP, then pp gather; small models and tests)."""
        return gather_dense(self.dense_state_dict(grads), self.mesh.pp_group)

    def load_dense_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load this rank's stages from a dense dict of the whole model (or of these stages)."""
        load_stage_dense(self.parts, state)

    @property
    def last_timing(self) -> StepTiming | None:
        """Wall and busy seconds of this rank's last :meth:`step`."""
        return self.timer.last

    def ideal_bubble(self) -> float:
        """``(p-1)/(m n)`` for this pipeline."""
        return ideal_bubble(self.mesh.pp_size, self.virtual_stages, self.n_microbatches)


def build_pipeline(config: GPTConfig, mesh: ParallelMesh, seed: int = 0, *, schedule: str | None = None,
                   virtual_stages: int = 1, n_microbatches: int | None = None, **kwargs) -> PipelineParallel:
    """:class:`PipelineParallel` for ``config`` on ``mesh`` (every rank calls it, same arguments)."""
    return PipelineParallel(config, mesh, seed, schedule=schedule, virtual_stages=virtual_stages,
                            n_microbatches=n_microbatches, **kwargs)
