"""A dry run: one rank of a run at its real scale, built and stepped on this machine (``seqpar train --dry-run``).

Rank ``R`` of a job of ``N`` ranks is built through the code that trains it: the run resolved by
:func:`~seqpar.train.resolve.resolve_run`, the mesh of :func:`~seqpar.distributed.mesh.init_parallel`
over a fake process group of ``N`` ranks (:func:`~seqpar.distributed.local.fake_world`: collectives
return at once, nothing is sent), and under ``FakeTensorMode`` (tensors with shapes, dtypes and
devices but no storage) the step engine of :func:`~seqpar.parallel.engine.build_engine` (this
rank's layers and shards only, FSDP2 or its pipeline stages), the precision recipe and AdamW. It
then runs the Trainer's own step function, :func:`~seqpar.train.step.run_step`, on token batches of
the run's shapes: every micro-batch's forward and backward (a pipeline rank: one schedule's worth),
the clip, the step's world all-reduce, the optimizer step, with ``attention: sdpa`` run as the
target device runs it (:mod:`seqpar.tools.dryrun_sdpa`). What is measured is observed from outside:
training-state bytes (:func:`~seqpar.parallel.data_parallel.state_bytes`), the peak of the saved
activations (the engines' own ledgers), every collective by kind, group and bytes
(:mod:`seqpar.tools.dryrun_comm`). No data is read and nothing is written.

What a fake run cannot read is a fake tensor's value. The token batches are real (zeros, a few
kilobytes), and :class:`FakeRun` computes what depends on them alone for real, so the model's
checks of token ids run as they do in training. Two reads of fake values are answered as every
rank would answer them: the pipeline schedule's warm-up vote (every stage has static shapes) and
the step's flags (a finite loss, no stop, finite gradients: the optimizer step is taken). An MoE
layer's routing (its tokens per expert, and under ep the counts exchanged and read for the
all-to-all's splits) is answered as the planner assumes it, balanced
(:mod:`seqpar.tools.dryrun_routing`). Any other read stops the run naming the line.
"""
from __future__ import annotations

import contextlib
import dataclasses
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.nn.modules.module import register_module_module_registration_hook
from torch.utils._pytree import tree_leaves

from ..distributed.collectives import world_group
from ..distributed.layouts import local_tensor
from ..distributed.local import fake_world
from ..distributed.mesh import ParallelMesh, init_parallel
from ..errors import UserError
from ..model.gpt import Block
from ..model.moe import expert_parameters
from ..model.modes import resolve_attention
from ..parallel.data_parallel import state_bytes
from ..parallel.engine import PipelineEngine, StepEngine, build_engine
from ..parallel.precision import Precision, resolve_precision
from ..train import step as train_step
from ..train.optim import build_optimizer
from ..train.resolve import ResolvedRun
from .dryrun_comm import StepComm, group_names, record_step
from . import dryrun_routing
from .dryrun_sdpa import TargetAttention

# value reads a fake step cannot compute, answered as every rank would answer them:
# (function, a part of its file's path) -> the value read
ANSWERS = {("_warmup_p2p", "pipelining"): 1,        # the schedule's warm-up vote: every stage has static shapes
           ("agree", train_step.__file__): 0}        # the step's flags: finite loss, no stop, finite gradients

# where a tensor made from host values (``torch.tensor([...])``) is host bookkeeping, kept real so
# it can be read: a DeviceMesh's rank table (FSDP2's mesh of the edp ranks is made inside the build)
HOST_BOOKKEEPING = ("torch/distributed/device_mesh.py",)


@dataclass
class RankRun:
    """What the dry run of one rank built and measured."""

    rank: int
    world: int
    coords: dict[str, tuple[int, int]]  # "pp" / "dp" / "cp" / "ep" / "tp" -> (this rank's index, size)
    stages: list[int]                   # pipeline stages (model chunks) this rank holds
    layers_built: int                   # transformer layers built on this rank (kept or not)
    parameters: int                     # parameters on this rank (its shards)
    micro_batches: int                  # micro-batches of the step on this rank
    state: dict[str, int]               # parameters / gradients / optimizer bytes after the step
    experts: dict[str, int]             # of them the routed experts': parameters / gradients
    saved: dict[str, int]               # peak saved activations: "layers", "outside_layers"
    comm: list[dict]                    # StepComm.table(): collectives by group and kind
    precision: str                      # the resolved train.precision
    seconds: float = 0.0
    peak_rss: int = 0                   # bytes: the process's peak resident memory during the rank's run
    notes: list[str] = field(default_factory=list)


class FakeRun(FakeTensorMode):
    """``FakeTensorMode`` for a dry run. An operator on plain real tensors only (the token batches,
    what is computed from them alone, generator states) runs on them for real; any fake argument
    makes the result fake. The ``c10d`` operators are counted into ``comm`` when set (one Python
    mode, not two, on every operator). And it answers what a fake run cannot compute, a fake
    tensor's value, where the peers' answer is known (:data:`ANSWERS`); a constant the mode knows
    (AdamW's step count) is read as usual; any other read raises naming the line."""

    def __init__(self):
        super().__init__(allow_non_fake_inputs=True)
        self.comm: StepComm | None = None

    def dispatch(self, func, types, args=(), kwargs=None):
        if self.comm is not None:
            self.comm.observe(func, args)
        routed = dryrun_routing.answer(func, args, kwargs)
        if routed is not None:
            return routed
        if func in self.lift_fns and _real_only(args, kwargs) and _inside(HOST_BOOKKEEPING):
            return args[0]  # e.g. FSDP2's DeviceMesh of the edp ranks: its rank table stays real
        if func not in self.lift_fns and _real_only(args, kwargs):
            out = func(*args, **(kwargs or {}))
            dryrun_routing.mirror_counts(func, args)
            return out
        if func is not torch.ops.aten._local_scalar_dense.default:
            return super().dispatch(func, types, args, kwargs)
        try:
            return super().dispatch(func, types, args, kwargs)
        except DataDependentOutputException:
            answer = _answer()
            if answer is None:
                raise RuntimeError(f"the step reads a tensor's value ({_caller()}), which a dry run on fake "
                                   f"tensors cannot; values may be read only outside the training step") from None
            return float(answer) if args[0].is_floating_point() else answer


def _real_only(args, kwargs) -> bool:
    """Whether the operator's tensor arguments are all plain real tensors (and there is one)."""
    tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(type(x) is torch.Tensor for x in tensors)


def _inside(files: tuple[str, ...]) -> bool:
    """Whether a caller on the current stack runs code of one of ``files`` (path endings)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(files):
            return True
        frame = frame.f_back
    return False


def _answer() -> int | None:
    """The :data:`ANSWERS` value of the innermost caller it names, else None."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        for (name, where), value in ANSWERS.items():
            if code.co_name == name and where in code.co_filename:
                return value
        frame = frame.f_back
    return None


def _caller() -> str:
    """The innermost frame of the current stack outside torch and this module, as ``file:line (function)``."""
    skip = (str(Path(torch.__file__).parent), __file__)
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return "inside torch"
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"


def reset_peak_rss() -> None:
    """Start the process's peak resident memory afresh (Linux; elsewhere the peak of the process)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss() -> int:
    """Bytes: the process's peak resident memory since :func:`reset_peak_rss`."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def fake_batches(run: ResolvedRun) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step's micro-batches on this rank: ``accum`` pairs of token ids ``[micro_batch, seq_len]``,
    real zeros even under the caller's FakeTensorMode (the model checks token ids' values)."""
    shape = (run.cfg.train.micro_batch, run.cfg.model.seq_len)
    with unset_fake_temporarily():
        return [(torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)) for _ in range(run.accum)]


def build(run: ResolvedRun, mesh: ParallelMesh, device: str) -> tuple[StepEngine, torch.optim.Optimizer, Precision]:
    """This rank's step engine, AdamW and precision recipe, as :class:`~seqpar.train.trainer.Trainer`
    builds them; ``device`` ("cuda" / "cpu"): what ``train.precision: auto`` and ``model.attention:
    auto`` resolve for (the fake tensors are CPU tensors, whatever the target)."""
    tc = run.cfg.train
    precision = Precision(resolve_precision(tc.precision, torch.device(device)), mesh.device,
                          fsdp=run.dp_mode == "fsdp")
    replicas = mesh.dp_size * mesh.cp_size  # DDP reduces over dp x cp
    if run.dp_mode == "ddp" and replicas > 1 and mesh.pp_size == 1 and not precision.master_weights:
        over = f"dp={mesh.dp_size}" + (f" x cp={mesh.cp_size}" if mesh.cp_size > 1 else "")
        raise UserError(f"data_parallel=ddp over {over} in {precision.name} runs torch's "
                        f"DistributedDataParallel, whose C++ reducer needs real tensors: a dry run cannot build it "
                        f"(train.precision=bf16 reduces through seqpar's own gradient buckets, "
                        f"parallel.data_parallel=fsdp through FSDP2)")
    cfg = run.cfg
    if cfg.model.attention == "auto":  # the target device's kernel, not the fake tensors' CPU one
        model = dataclasses.replace(cfg.model, attention=resolve_attention("auto", device))
        cfg = dataclasses.replace(cfg, model=model)
    engine = build_engine(cfg, mesh, accum=run.accum, precision=precision)
    precision.check_model(engine.module)
    optimizer = build_optimizer(engine.module, lr=tc.lr, weight_decay=tc.weight_decay, betas=(tc.beta1, tc.beta2))
    return engine, optimizer, precision


@contextlib.contextmanager
def count_built_layers() -> Iterator[list[torch.nn.Module]]:
    """Inside the block, every transformer layer (:class:`~seqpar.model.gpt.Block`) made part of a
    module, each once, whether or not the rank keeps it: a pipeline rank must build only its own."""
    built: list[torch.nn.Module] = []

    def hook(parent, name, module):
        if isinstance(module, Block) and not any(m is module for m in built):
            built.append(module)

    handle = register_module_module_registration_hook(hook)
    try:
        yield built
    finally:
        handle.remove()


def saved_activations(engine: StepEngine) -> dict[str, int]:
    """The peak saved activations the engine measured in its first step, inside and outside the layers."""
    if isinstance(engine, PipelineEngine):
        return {"layers": engine.peak or 0, "outside_layers": engine.peak_outside or 0}
    layers, total = engine.probe.in_layers or 0, engine.probe.measured or 0
    return {"layers": layers, "outside_layers": total - layers}


def step(run: ResolvedRun, engine: StepEngine, optimizer: torch.optim.Optimizer, names: dict[str, str],
         mode: FakeRun | None = None):
    """One optimizer step by the Trainer's step function (:func:`~seqpar.train.step.run_step`), its
    collectives recorded; returns ``(StepComm, state bytes)`` (with the routed experts' parameter
    and gradient bytes, ``expert_parameters`` / ``expert_gradients``). ``mode``: the dry run's
    :class:`FakeRun`, which counts the ``c10d`` operators (else a
    :class:`~seqpar.tools.dryrun_comm.RawCollectives` mode does)."""
    with record_step(engine.module, names, raw=mode is None) as comm:
        if mode is not None:
            mode.comm = comm
        try:
            train_step.run_step(engine, optimizer, fake_batches(run), grad_clip=run.cfg.train.grad_clip)
        finally:
            if mode is not None:
                mode.comm = None
    state = state_bytes(engine.module, optimizer)
    experts = list(expert_parameters(engine.module).values())  # routed experts: reduced over edp, not dp
    state["expert_parameters"] = sum(local_tensor(p).numel() * p.element_size() for p in experts)
    state["expert_gradients"] = sum(local_tensor(p.grad).numel() * p.grad.element_size() for p in experts
                                    if p.grad is not None)
    optimizer.zero_grad(set_to_none=True)
    return comm, state


def step_group_names(mesh: ParallelMesh, engine: StepEngine) -> dict[str, str]:
    """The labels of the groups a step of ``engine`` talks over (:func:`~seqpar.tools.dryrun_comm.group_names`
    with the pipeline's tied first + last stage pair)."""
    tied = getattr(getattr(engine, "pipe", None), "tied_group", None)
    return group_names(getattr(engine, "mesh", mesh), {"first + last stage": tied})  # the engine's: with ep, edp


def _coords(mesh: ParallelMesh) -> dict[str, tuple[int, int]]:
    return {"pp": (mesh.pp_rank, mesh.pp_size), "dp": (mesh.dp_rank, mesh.dp_size),
            "cp": (mesh.cp_rank, mesh.cp_size), "ep": (mesh.ep_rank, mesh.ep_size), "tp": (mesh.tp_rank, mesh.tp_size)}


def _run_rank(run: ResolvedRun, rank: int, device: str) -> RankRun:
    pc = run.cfg.parallel
    if world_group() is not None:
        raise UserError("a dry run needs a process without a process group (it makes a fake one of its own)")
    dryrun_routing.check_routing(run.cfg.model)
    with fake_world(run.world_size, rank):
        mesh = init_parallel(pc.tp, run.dp, pp=pc.pp, cp=pc.cp)
        if mesh.cp_size > 1:
            mesh.dp_cp_mesh  # DeviceMesh's index tensors are host bookkeeping: made now, real, and cached
        with FakeRun() as mode, TargetAttention(device):
            with count_built_layers() as built:
                engine, optimizer, precision = build(run, mesh, device)
            layers_built = len(built)
            del built
            comm, state = step(run, engine, optimizer, step_group_names(mesh, engine), mode)
        return RankRun(rank=rank, world=run.world_size, coords=_coords(engine.mesh),
                       stages=[getattr(p, "index", 0) for p in engine.parts], layers_built=layers_built,
                       parameters=sum(p.numel() for p in engine.module.parameters()), micro_batches=run.accum,
                       state={k: state[k] for k in ("parameters", "gradients", "optimizer")},
                       experts={k: state[f"expert_{k}"] for k in ("parameters", "gradients")},
                       saved=saved_activations(engine), comm=comm.table(), precision=precision.name)


def dry_run_rank(run: ResolvedRun, rank: int, device: str = "cuda") -> RankRun:
    """Build rank ``rank`` of ``run`` on fake tensors and run one step (module docstring); a
    :class:`UserError` from the build is re-raised naming the rank (any other error is a bug and
    keeps its traceback)."""
    if not 0 <= rank < run.world_size:
        raise UserError(f"--rank {rank} is not a rank of a job of {run.world_size} (0 ... {run.world_size - 1})")
    reset_peak_rss()
    start = time.perf_counter()
    try:
        out = _run_rank(run, rank, device)
    except UserError as err:
        raise UserError(f"rank {rank} of {run.world_size}: {err}") from err
    out.seconds, out.peak_rss = time.perf_counter() - start, peak_rss()
    return out


def default_ranks(world: int, pp: int) -> list[int]:
    """The first rank of the first and of the last pipeline stage."""
    return sorted({0, (pp - 1) * (world // pp)})


__all__ = ["ANSWERS", "FakeRun", "RankRun", "build", "count_built_layers", "default_ranks", "dry_run_rank",
           "fake_batches", "peak_rss", "reset_peak_rss", "saved_activations", "step", "step_group_names"]
