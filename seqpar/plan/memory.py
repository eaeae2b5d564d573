"""Bytes per GPU of a layout: model state plus activations of the busiest pipeline stage.

Composed from :mod:`seqpar.memory`, which holds every byte formula:

* Parameters per TP rank: :func:`seqpar.memory.params.stage_params`.
* Training state (``parameters``, ``gradients``, ``optimizer`` kept across steps and
  ``state_during_step``): :func:`seqpar.memory.state.training_state_bytes` for ``precision`` x
  ``data_parallel``; the same figures ``seqpar memory CONFIG --dp N`` prints. An MoE model's rank
  holds ``E/ep`` routed experts per MoE layer, sharded under FSDP2 over the ``dp x cp / ep``
  expert-data-parallel ranks (:func:`state_parts`).
* Activations: Table 2's per-layer bytes as this config runs them
  (:func:`seqpar.memory.whole_model.layer_bytes`, one layer per recompute mode) for every layer
  the stage holds in flight (:func:`seqpar.memory.schedule.in_flight_per_layer`: stage r of a
  1F1B pipeline holds p - r micro-batches of its L/p layers; interleaved, the first stage holds
  §4.2.3's L (1 + (p-1)/(pm))). §4.3's terms (:func:`seqpar.memory.whole_model.outside_terms`):
  the embedding-dropout mask for each micro-batch the first model chunk holds at the peak
  (:func:`seqpar.memory.schedule.first_chunk_in_flight`) on the first stage; final LayerNorm
  input, output-layer input and what the cross-entropy keeps on the last: the logits in their own
  dtype (``2sbv/t`` in bf16, not the paper's fp32 ``4sbv/t``) and 8 bytes a token (its fp32
  log-sum-exp and int32 target code; :func:`seqpar.memory.formulas.cross_entropy_terms`).
* Backward transient (:mod:`seqpar.memory.transient`): the gradients flowing back through one
  layer, at most that layer's stored activations for one micro-batch, plus, while a checkpointed
  unit is recomputed, its activations again (N layers under full recompute, the attention scores
  under selective); under cp the attention kernel's fp32 working set of one ``[c, c]`` block.
* Allowance: :data:`WORKSPACE_BYTES` for the CUDA context, cuBLAS workspaces and NCCL buffers, plus
  :data:`FRAGMENTATION` of everything else for the caching allocator's fragmentation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..memory.params import expert_params, layer_params, root_params, stage_params
from ..memory.schedule import first_chunk_in_flight, in_flight_per_layer
from ..memory.state import state_bytes_per_parameter, training_state_bytes
from ..memory.transient import backward_transient_bytes, context_block_bytes
from ..memory.whole_model import layer_bytes, outside_terms
from ..model.config import GPTConfig
from ..model.modes import RECOMPUTE_MODES, RecomputeMode, resolve_attention
from . import dims
from .gpus import GIB
from .experts import expert_shards
from .layout import Layout, micro_batches

# CUDA context with the cuBLAS/cuDNN kernels loaded (~1 GiB), NCCL communicators (a TP ring over
# NVSwitch keeps ~0.5 GiB of channel buffers; pipeline and data-parallel peers add more; ~1 GiB),
# cuBLAS workspaces, RNG states and small buffers (~0.5 GiB)
WORKSPACE_BYTES = 2.5 * GIB
FRAGMENTATION = 0.05        # of all tensor bytes: allocator blocks that cannot be reused
# of the GPU's memory, left free by the layouts the search ranks (beyond the allowance above): the
# formulas leave out a few percent (the ledger agrees within 3%), so a layout predicted at 99.9% of
# the GPU is a gamble, not a plan; budgets (train.memory_budget_gib) are taken as given
HEADROOM = 0.05
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}  # the precisions the planner models
STATE_PARTS = ("parameters", "gradients", "optimizer", "state_during_step")


def state_parts(model: GPTConfig, layout: Layout, stage: int, precision: str) -> dict[str, float]:
    """Training-state bytes of one GPU of pipeline stage ``stage``, by :data:`STATE_PARTS`. An MoE
    model's routed experts (``E/ep`` per MoE layer, :func:`expert_params`) shard under FSDP2 over the
    expert-data-parallel ranks (an FSDP unit of their own per layer), everything else over dp x cp."""
    t, p, shards = layout.tp, layout.pp, layout.dp * layout.cp  # FSDP2 shards over dp x cp
    experts = expert_params(model, t, pp=p, stage=stage, ep=layout.ep)
    dense_unit, expert_unit = unit_params(model, t, layout.ep)
    per = state_bytes_per_parameter(precision, layout.data_parallel, dp=shards)
    b = training_state_bytes(per, params=stage_params(model, t=t, pp=p, stage=stage, ep=layout.ep) - experts,
                             unit_params=dense_unit, dp=shards,
                             root=root_params(model, t, first=stage == 0, last=stage == p - 1, pp=p))
    if experts:
        per_e = state_bytes_per_parameter(precision, layout.data_parallel, dp=layout.edp)
        e = training_state_bytes(per_e, params=experts, unit_params=expert_unit, root=0,
                                 dp=expert_shards(model, layout))  # FSDP2's padding of E/ep over edp
        b = {k: v + e[k] for k, v in b.items()}
    return {"parameters": b["parameters"], "gradients": b["gradients"], "optimizer": b["optimizer"],
            "state_during_step": b["step_transient"]}


def unit_params(model: GPTConfig, t: int, ep: int = 1) -> tuple[int, int]:
    """(largest layer less its routed experts, one MoE layer's routed experts) on one rank: the
    FSDP2 units gathered during a step (a dense model: one layer, 0)."""
    if model.moe is None:
        return layer_params(model, t), 0
    kinds = [next((i for i in range(model.layers) if model.moe.is_moe_layer(i) == moe), None) for moe in (False, True)]
    dense, first_moe = kinds
    experts = expert_params(model, t, pp=model.layers, stage=first_moe, ep=ep)  # one layer per "stage": that one
    other = layer_params(model, t, layer=first_moe, ep=ep) - experts
    return max(other, layer_params(model, t, layer=dense) if dense is not None else 0), experts


_PER_LAYER_CACHE: dict[tuple, dict[RecomputeMode, int]] = {}


def per_layer_activations(model: GPTConfig, layout: Layout, precision: str = "bf16",
                          device: str = "cuda") -> dict[RecomputeMode, int]:
    """Bytes one layer keeps for backward for one micro-batch, per recompute mode (full: the unit
    input), with the attention kernel ``device`` runs (the planner's GPUs: "cuda"), and the layout's
    ``model.recompute_ops`` (``layout.recompute.ops``) left out of the none / selective layers."""
    model = dims.with_recompute_ops(model, layout.recompute.ops)
    key = (dims.model_key(model), layout.tp, layout.sequence_parallel, layout.micro_batch, precision, layout.cp,
           device, repr(model.moe), layout.ep)
    if key not in _PER_LAYER_CACHE:
        cfg = dims.with_sequence_parallel(model, layout.sequence_parallel)
        dims_ = dict(s=model.seq_len // layout.cp, b=layout.micro_batch, t=layout.tp, act=ACTIVATION_BYTES[precision],
                     cp=layout.cp, device=device, ep=layout.ep)
        n_moe = model.moe.moe_layer_count(model.layers) if model.moe is not None else 0
        kinds = {False: model.layers - n_moe, True: n_moe}  # layers without and with an MoE FFN
        # an MoE model's layers differ: the mean over its layers (dense and MoE) stands for one
        _PER_LAYER_CACHE[key] = {mode: round(sum(n * layer_bytes(cfg, mode, **dims_, moe=e) for e, n in kinds.items() if n)
                                             / model.layers) for mode in RECOMPUTE_MODES}
    return _PER_LAYER_CACHE[key]


def rebuilt_bytes(model: GPTConfig, layout: Layout, precision: str = "bf16") -> int:
    """Bytes one none / selective layer rebuilds in backward for one micro-batch under the layout's
    ``model.recompute_ops`` (what it no longer keeps): backward writes them once more."""
    if not layout.recompute.ops:
        return 0
    plain = per_layer_activations(replace(model, recompute_ops=()), replace(layout, recompute=replace(layout.recompute,
                                                                                                       ops=())), precision)
    return plain["none"] - per_layer_activations(model, layout, precision)["none"]


def inflight_layers(layout: Layout, n_micro: int, stage: int) -> float:
    """Layers' worth of one micro-batch's activations that stage ``stage`` holds at its peak, per layer it owns."""
    return float(in_flight_per_layer(pp_rank=stage, pp=layout.pp, virtual_stages=layout.virtual_stages,
                                     n_microbatches=n_micro))


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the busiest stage, by part, against the GPU's capacity."""

    parts: dict[str, float]
    capacity: float
    stage: int
    headroom: float = 0.0  # bytes of ``capacity`` the layout must leave free

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total + self.headroom <= self.capacity

    def overflow(self) -> str:
        """Which term makes the layout overflow, and by how much (empty when it fits)."""
        if self.fits:
            return ""
        over = self.total + self.headroom - self.capacity
        if self.total <= self.capacity:
            return (f"needs {self.total / GIB:.2f} GiB of {self.capacity / GIB:.2f} GiB on stage {self.stage}, "
                    f"leaving less than the {self.headroom / GIB:.2f} GiB headroom (short by {over / GIB:.2f} GiB)")
        name, size = max(((k, v) for k, v in self.parts.items() if k != "workspace"), key=lambda kv: kv[1])
        cut = over / (1 + FRAGMENTATION)  # the allowance shrinks with it
        kept = f" less the {self.headroom / GIB:.2f} GiB headroom" if self.headroom else ""
        head = (f"needs {self.total / GIB:.2f} GiB of {self.capacity / GIB:.2f} GiB{kept} on stage {self.stage}, "
                f"over by {over / GIB:.2f} GiB; ")
        if cut >= size:  # no single term can make room: say so instead of a negative size
            return head + f"more than even the largest term, {name} ({size / GIB:.2f} GiB), holds"
        return head + (f"the largest term, {name} ({size / GIB:.2f} GiB), would have to shrink by {cut / GIB:.2f} GiB "
                       f"to {(size - cut) / GIB:.2f} GiB")


def context_transient(model: GPTConfig, layout: Layout, device: str = "cuda") -> float:
    """The context-parallel kernel's backward transient of ``layout`` on ``device``
    (:func:`context_block_bytes`; ``attention: auto`` is sdpa on CUDA)."""
    attention = resolve_attention(model.attention, device)
    return float(context_block_bytes(heads=model.heads, seq_len=model.seq_len, micro_batch=layout.micro_batch,
                                     t=layout.tp, cp=layout.cp, attention=attention, cp_comm=layout.cp_comm,
                                     kv_heads=model.held_kv_heads(layout.tp) // layout.tp, head_dim=model.head_dim))


def _stage_memory(model: GPTConfig, layout: Layout, n_micro: int, stage: int, precision: str,
                  device: str = "cuda", workspace: float = WORKSPACE_BYTES) -> dict[str, float]:
    chunk = model.layers // (layout.pp * layout.virtual_stages)
    counts = layout.recompute.per_stage(chunk, layout.virtual_stages)
    per = per_layer_activations(model, layout, precision, device)
    rc = layout.recompute
    full_units = counts["full"]
    if rc.kind == "full" and rc.method == "uniform":
        full_units = layout.virtual_stages * math.ceil(chunk / rc.num_layers)
    held = counts["none"] * per["none"] + counts["selective"] * per["selective"] + full_units * per["full"]
    unit = (rc.num_layers if (rc.kind == "full" and rc.method == "uniform") else 1) if counts["full"] else 0
    working = backward_transient_bytes(per, unit_layers=unit, selective=bool(counts["selective"]))
    working += context_transient(model, layout, device)
    parts = state_parts(model, layout, stage, precision)
    parts["activations"] = held * inflight_layers(layout, n_micro, stage)
    cfg = dims.with_sequence_parallel(model, layout.sequence_parallel)
    outside = outside_terms(cfg, s=model.seq_len // layout.cp, b=layout.micro_batch, t=layout.tp, act=ACTIVATION_BYTES[precision],
                            in_flight=first_chunk_in_flight(pp=layout.pp, virtual_stages=layout.virtual_stages,
                                                             n_microbatches=n_micro),
                            first=stage == 0, last=stage == layout.pp - 1)
    parts["outside_layers"] = float(sum(outside.values()))
    parts["backward_transient"] = working
    parts["workspace"] = allowance(parts, workspace)
    return parts


def allowance(parts: dict[str, float], workspace: float = WORKSPACE_BYTES) -> float:
    """What no tensor shows: ``workspace`` (:data:`WORKSPACE_BYTES` on a GPU) plus
    :data:`FRAGMENTATION` of ``parts`` (every other term, in bytes)."""
    return workspace + FRAGMENTATION * sum(v for k, v in parts.items() if k != "workspace")


def stage_memory(model: GPTConfig, layout: Layout, capacity: float, global_batch: int, stage: int,
                 precision: str = "bf16", device: str = "cuda", workspace: float = WORKSPACE_BYTES) -> Memory:
    """Bytes per GPU by part on pipeline stage ``stage`` (0 = first) of ``layout``; ``device``: whose
    attention kernels the activations count ("cpu" for a dry run resolved for the CPU); ``workspace``:
    the allowance for the CUDA context, cuBLAS workspaces and NCCL buffers (0 for a CPU rank)."""
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision must be one of {sorted(ACTIVATION_BYTES)}, got {precision!r}")
    if not 0 <= stage < layout.pp:
        raise ValueError(f"stage must lie in [0, {layout.pp}), got {stage}")
    parts = _stage_memory(model, layout, micro_batches(layout, global_batch), stage, precision, device, workspace)
    return Memory(parts, capacity, stage)


def memory_per_gpu(model: GPTConfig, layout: Layout, capacity: float, global_batch: int,
                   precision: str = "bf16", headroom: float = 0.0) -> Memory:
    """Bytes per GPU by part on the busiest pipeline stage (the first, or the last for small p);
    it fits when ``headroom`` bytes of ``capacity`` are left free."""
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision must be one of {sorted(ACTIVATION_BYTES)}, got {precision!r}")
    n_micro = micro_batches(layout, global_batch)
    stages = {0} | {layout.pp - 1}
    best = max(((_stage_memory(model, layout, n_micro, r, precision), r) for r in stages),
               key=lambda pr: sum(pr[0].values()))
    return Memory(best[0], capacity, best[1], headroom)
