"""Data parallelism for the Trainer: ``ddp`` (replicated state, all-reduced gradients) or ``fsdp``
(parameters, gradients and AdamW state sharded over dp with FSDP2), behind one interface.

The engine (:class:`~seqpar.parallel.engine.PlainEngine`, where the step's order is described)
wraps each micro-batch in :meth:`DataParallel.micro_batch`, then calls
:meth:`DataParallel.after_backward` and :meth:`DataParallel.clip`. Under ddp with the bf16 recipe
the fp32 dp all-reduce runs bucket by bucket during the last backward
(:class:`~seqpar.parallel.grad_buckets.GradBuckets`).

Context parallelism: a CP rank's gradient is its tokens' share, so gradients are summed over cp
and averaged over dp. Under ddp that is one bucketed reduction over the dp x cp group during
backward, each bucket divided by dp only (torch DDP with a communication hook, or the bf16
recipe's buckets); under fsdp one reduce-scatter over dp x cp (then scaled by cp).
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager

import torch
import torch.nn as nn

from ..distributed.collectives import ProcessGroup, all_reduce_future
from ..distributed.grad_sync import sync_sp_replicated_grads
from ..distributed.mesh import ParallelMesh
from ..sharding import local_tensor
from ..model.modes import DATA_PARALLEL_MODES
from ..model.moe import moe_layers
from .fsdp import apply_fsdp, set_micro_batch, sync_sharded_sp_grads
from .grad_buckets import DEFAULT_BUCKET_MIB, GradBuckets
from .expert_grads import ExpertGrads, finish_moe_step
from .grads import clip_grad_norm


class DataParallel:
    """Wraps ``model`` for ``mode`` over ``mesh``'s dp group. ``module`` is what the training
    forward runs through; the parameters the optimizer and checkpoints use are ``model``'s own
    (under fsdp, DTensors holding this rank's shard)."""

    def __init__(self, model: nn.Module, mesh: ParallelMesh, mode: str, *, precision: str = "fp32",
                 master_weights: bool = False, reshard_after_forward: bool = True,
                 bucket_mib: float = DEFAULT_BUCKET_MIB):
        if mode not in DATA_PARALLEL_MODES:
            raise ValueError(f"parallel.data_parallel must be one of {list(DATA_PARALLEL_MODES)}, got {mode!r}")
        self.model, self.mesh, self.mode = model, mesh, mode
        # fsdp shards over dp x cp (the CP ranks hold the same parameters), as torchtitan does
        self.sharded = mode == "fsdp" and mesh.dp_size * mesh.cp_size > 1
        self.master_weights = master_weights  # ddp + the bf16 recipe: fp32 grads reduced here
        self.buckets = None  # ddp + the bf16 recipe: GradBuckets, reduced while backward runs
        self.norm_group = mesh.dp_group  # the ranks whose gradients differ: dp, or dp x cp when sharded
        self.experts = ExpertGrads(model, mesh)  # ep > 1: expert grads reduced over edp, not by DDP/FSDP
        self.has_moe = bool(moe_layers(model))  # a dense model's step never looks for experts
        self.expert_buckets = None  # ep > 1 + the bf16 recipe: expert grads in buckets over edp, after the rest
        if self.sharded:
            shard_mesh = mesh.dp_cp_mesh
            self.norm_group = shard_mesh.get_group() if mesh.cp_size > 1 else mesh.dp_group
            expert_mesh = self.experts.fsdp_mesh()  # FSDP2 over edp for the experts (None: edp = 1)
            self.module = apply_fsdp(model, shard_mesh, reshard_after_forward=reshard_after_forward,
                                     precision=precision, expert_mesh=expert_mesh, experts=self.experts.params)
            self.experts.reduced_by_fsdp = expert_mesh is not None
        elif mesh.dp_size * mesh.cp_size > 1 and master_weights:  # summed over cp, averaged over dp
            self.buckets = GradBuckets(model, mesh.dp_cp_group, bucket_mib, divide_by=mesh.dp_size,
                                       skip=self.experts.names)
            if self.experts.active:  # reduced in finish() only, after the dense ones: one order on every rank
                self.expert_buckets = GradBuckets(model, mesh.edp_group, bucket_mib, divide_by=mesh.dp_size,
                                                  names=self.experts.names)
                self.experts.reduced_by_buckets = True
            self.module = model
        elif mesh.dp_size * mesh.cp_size > 1:
            self.module = wrap_ddp(model, mesh, bucket_mib, ignore=self.experts.names)
        else:
            self.module = model

    def begin_step(self, weights: dict[str, torch.Tensor] | None) -> None:
        """Before an optimizer step's first micro-batch, with its compute ``weights`` (the bf16 copies;
        None in other precisions): the gradient buckets take over accumulating into the masters."""
        if self.buckets is not None and weights is not None:
            self.buckets.begin(weights)
            if self.expert_buckets is not None:
                self.expert_buckets.begin(weights)

    def micro_batch(self, micro: int, accum: int) -> AbstractContextManager:
        """Around micro-batch ``micro`` of ``accum``: gradients are reduced over dp on the last only."""
        last = micro == accum - 1
        if self.buckets is not None and last:
            self.buckets.last_micro_batch()
        if self.sharded:
            set_micro_batch(self.model, last)
            return contextlib.nullcontext()
        if last or self.module is self.model:
            return contextlib.nullcontext()
        return self.module.no_sync()

    def after_backward(self) -> None:
        """Once per optimizer step, after the last backward: waiting for the bf16 recipe's fp32
        buckets (ddp; reduced over dp x cp during backward), then SP-replicated gradients summed
        over TP (on the dp x cp shards under fsdp)."""
        tp, cp = self.mesh.tp_group, self.mesh.cp_size
        if self.buckets is not None:
            self.buckets.finish()
        if self.expert_buckets is not None:
            self.expert_buckets.finish()
        if cp > 1 and self.sharded:  # FSDP averaged the shares over dp x cp: a sum over cp, a mean over dp only
            plain = {id(p) for p in self.experts.params} if not self.experts.reduced_by_fsdp else set()
            grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None and id(p) not in plain]
            torch._foreach_mul_(grads, float(cp))
        if self.sharded:
            sync_sharded_sp_grads(self.model, tp)
        else:
            sync_sp_replicated_grads(self.model, tp)
        if self.has_moe:
            self.experts.reduce()  # over edp, divided by dp (under FSDP2: its edp mean, scaled by 1/ep)
            finish_moe_step(self.model, self.mesh.dp_group)  # counts are summed over tp (SP) and cp already

    def clip(self, max_norm: float) -> torch.Tensor:
        """Global gradient norm of the full model before clipping (clipped in place when > 0)."""
        return clip_grad_norm(self.model, max_norm, tp_group=self.mesh.tp_group, dp_group=self.norm_group,
                              device=self.mesh.device, experts=self.experts.params if self.has_moe else (),
                              expert_dp_group=self.mesh.edp_group,
                              data_group=self.mesh.dp_cp_group)


def wrap_ddp(model: nn.Module, mesh: ParallelMesh, bucket_mib: float = DEFAULT_BUCKET_MIB,
             ignore: Sequence[str] = ()) -> nn.Module:
    """torch DDP over the dp x cp group: gradients in buckets of about ``bucket_mib`` MiB, each
    all-reduced as soon as backward has produced it. Under context parallelism each bucket is
    divided by dp, not dp x cp, before it is summed: the CP ranks' shares add up, dp averages.
    ``ignore``: parameter names DDP leaves alone (expert weights, reduced over edp instead)."""
    from torch.nn.parallel import DistributedDataParallel
    if ignore:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(ignore))
    kwargs = {"broadcast_buffers": False} if any(True for _ in model.buffers()) else {}
    wrapped = DistributedDataParallel(model, process_group=mesh.dp_cp_group, bucket_cap_mb=bucket_mib, **kwargs)
    if mesh.cp_size > 1:
        wrapped.register_comm_hook((mesh.dp_cp_group, mesh.dp_size), _sum_over_cp_mean_over_dp)
    return wrapped


def _sum_over_cp_mean_over_dp(state: tuple[ProcessGroup, int], bucket):
    """DDP communication hook: one bucket divided by dp, then summed over dp x cp; returns the
    future of the bucket (no return annotation: DDP compares it unevaluated, and this module's
    annotations are strings)."""
    group, dp = state
    buf = bucket.buffer()
    if dp > 1:
        buf.div_(dp)
    return all_reduce_future(buf, group)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for training state, measured on the tensors themselves (their local
    shards): ``parameters``, ``gradients`` (``.grad``) and ``optimizer`` (AdamW's moments and
    step counters)."""
    params = list(model.parameters())
    out = {"parameters": sum(local_tensor(p).numel() * p.element_size() for p in params),
           "gradients": sum(local_tensor(p.grad).numel() * p.grad.element_size() for p in params
                            if p.grad is not None),
           "optimizer": 0}
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                out["optimizer"] += local_tensor(v).numel() * v.element_size()
    return out


def state_line(measured: dict[str, int]) -> str:
    """``state: X MiB per rank (parameters P, gradients G, optimizer O)``."""
    mib = {k: v / 2**20 for k, v in measured.items()}
    return (f"state: {sum(mib.values()):.2f} MiB per rank (parameters {mib['parameters']:.2f}, "
            f"gradients {mib['gradients']:.2f}, optimizer {mib['optimizer']:.2f})")


__all__ = ["DataParallel", "wrap_ddp", "state_bytes", "state_line"]
