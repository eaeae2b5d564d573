"""Bytes per GPU of a layout: model state plus activations of the busiest pipeline stage.

* Parameters per TP rank: each layer's QKV, projection and MLP weights split t ways (the column
  biases too; LayerNorms and row biases replicated); token embedding split t ways and position
  embedding whole on the first stage; final LayerNorm and (with p > 1, or untied) an output
  matrix of v/t x h on the last stage.
* State bytes per parameter (``precision``): ``bf16`` is seqpar's version of the paper's recipe:
  weights 4 (fp32 master) + 2 (bf16 compute copy), gradients 4 (fp32 accumulator) + 2 (the bf16
  gradient of the compute copy, held until it is added in), AdamW m and v 4 + 4: 20 bytes.
  ``fp32``: 4 + 4 + 8 = 16. ``fsdp`` divides all of it by dp and adds the unsharded copies of two
  layers (the one computing and the one prefetched): bf16 weights and fp32 gradients.
* Activations: Table 2's per-layer bytes as this config runs them
  (:func:`seqpar.memory.whole_model.model_activation_bytes`, one layer per recompute mode) for
  every layer the stage holds in flight. Stage r of a 1F1B pipeline holds p - r micro-batches of
  its L/p layers; with m interleaved chunks it holds 2(p - r - 1) + (m - 1)p + 1 chunks of L/(pm)
  layers (Megatron's warm-up plus the one running), which for the first stage is §4.2.3's
  L (1 + (p-1)/(pm)). §4.3's terms: the embedding-dropout mask for each in-flight micro-batch on
  the first stage; final LayerNorm input, output-layer input and fp32 logits on the last.
* Backward transient: the gradients flowing back through one layer, at most that layer's stored
  activations for one micro-batch, plus, while a checkpointed unit is recomputed, its activations
  again (N layers under full recompute, the attention scores under selective).
* Allowance: :data:`WORKSPACE_BYTES` for the CUDA context, cuBLAS workspaces and NCCL buffers, plus
  :data:`FRAGMENTATION` of everything else for the caching allocator's fragmentation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..memory.whole_model import model_activation_bytes
from ..model.config import GPTConfig
from . import dims
from .gpus import GIB
from .layout import MODES, Layout, Mode, micro_batches

# CUDA context with the cuBLAS/cuDNN kernels loaded (~1 GiB), NCCL communicators (a TP ring over
# NVSwitch keeps ~0.5 GiB of channel buffers; pipeline and data-parallel peers add more; ~1 GiB),
# cuBLAS workspaces, RNG states and small buffers (~0.5 GiB)
WORKSPACE_BYTES = 2.5 * GIB
FRAGMENTATION = 0.05        # of all tensor bytes: allocator blocks that cannot be reused
STATE_BYTES = {             # per parameter: (weights, gradients, optimizer)
    "bf16": (6, 6, 8),
    "fp32": (4, 4, 8),
}
ACTIVATION_BYTES = {"bf16": 2, "fp32": 4}
FSDP_UNSHARDED_LAYERS = 2   # the layer computing and the one prefetched


def layer_params(model: GPTConfig, t: int) -> int:
    """Parameters of one transformer layer held by one TP rank."""
    h, f, qkv, fc1 = model.hidden, model.ffn_hidden, dims.qkv_width(model), dims.fc1_width(model)
    weights = (h * qkv + h * h + h * fc1 + f * h) // t
    biases = (qkv + fc1) // t + 2 * h if model.bias else 0  # column biases split, row biases whole
    return weights + biases + 2 * dims.norm_params(model)


def stage_params(model: GPTConfig, layout: Layout, stage: int) -> int:
    """Parameters held by one GPU of pipeline stage ``stage`` (0 = first), before any dp sharding."""
    p, t, h = layout.pp, layout.tp, model.hidden
    n = layer_params(model, t) * model.layers // p
    vocab = dims.vocab_rows(model, t) * h // t
    if stage == 0:
        n += vocab + (model.seq_len * h if dims.learned_positions(model) else 0)
    if stage == p - 1:
        n += dims.norm_params(model)
        if p > 1 or not model.tie_embeddings:
            n += vocab
    return n


_PER_LAYER_CACHE: dict[tuple, dict[Mode, int]] = {}


def per_layer_activations(model: GPTConfig, layout: Layout, precision: str = "bf16") -> dict[Mode, int]:
    """Bytes one layer keeps for backward for one micro-batch, per recompute mode (full: the unit input)."""
    key = (dims.model_key(model), layout.tp, layout.sequence_parallel, layout.micro_batch, precision)
    if key not in _PER_LAYER_CACHE:
        out = {}
        for mode in MODES:
            cfg = replace(model, layers=1, recompute=mode, recompute_method="uniform", recompute_num_layers=1,
                          recompute_layers=None, sequence_parallel=layout.sequence_parallel)
            out[mode] = model_activation_bytes(cfg, t=layout.tp, micro_batch=layout.micro_batch,
                                               activation_bytes=ACTIVATION_BYTES[precision])["layers"]
        _PER_LAYER_CACHE[key] = out
    return _PER_LAYER_CACHE[key]


def inflight_layers(layout: Layout, n_micro: int, stage: int) -> float:
    """Layers' worth of one micro-batch's activations that stage ``stage`` holds at its peak, per layer it owns."""
    p, m = layout.pp, layout.virtual_stages
    if p == 1:
        return 1.0
    if m == 1:
        return float(min(p - stage, n_micro))
    chunks = min(2 * (p - stage - 1) + (m - 1) * p + 1, n_micro * m)
    return chunks / m


def outside_terms(model: GPTConfig, layout: Layout, precision: str, n_micro: int, stage: int) -> dict[str, float]:
    """§4.3's activations outside the layers on stage ``stage``, in bytes."""
    s, b, h, t = model.seq_len, layout.micro_batch, model.hidden, layout.tp
    rep = t if layout.sequence_parallel else 1
    u = ACTIVATION_BYTES[precision] / 2
    out = {}
    if stage == 0 and model.dropout > 0:
        out["embedding_dropout_mask"] = s * b * h / rep * min(layout.pp, n_micro)
    if stage == layout.pp - 1:
        out["final_layernorm_input"] = 2 * s * b * h * u / rep
        out["output_layer_input"] = 2 * s * b * h * u / rep
        out["logits_fp32"] = 4 * s * b * dims.vocab_rows(model, t) / t
    return out


@dataclass(frozen=True)
class Memory:
    """Bytes per GPU on the busiest stage, by part, against the GPU's capacity."""

    parts: dict[str, float]
    capacity: float
    stage: int

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def overflow(self) -> str:
        """Which term makes the layout overflow, and by how much (empty when it fits)."""
        if self.fits:
            return ""
        over = self.total - self.capacity
        name, size = max(((k, v) for k, v in self.parts.items() if k != "workspace"), key=lambda kv: kv[1])
        cut = over / (1 + FRAGMENTATION)  # the allowance shrinks with it
        return (f"needs {self.total / GIB:.2f} GiB of {self.capacity / GIB:.2f} GiB on stage {self.stage}, over by "
                f"{over / GIB:.2f} GiB; the largest term, {name} ({size / GIB:.2f} GiB), would have to shrink by "
                f"{cut / GIB:.2f} GiB to {(size - cut) / GIB:.2f} GiB")


def _stage_memory(model: GPTConfig, layout: Layout, n_micro: int, stage: int, precision: str) -> dict[str, float]:
    chunk = model.layers // (layout.pp * layout.virtual_stages)
    counts = layout.recompute.per_stage(chunk, layout.virtual_stages)
    per = per_layer_activations(model, layout, precision)
    rc = layout.recompute
    full_units = counts["full"]
    if rc.kind == "full" and rc.method == "uniform":
        full_units = layout.virtual_stages * math.ceil(chunk / rc.num_layers)
    held = counts["none"] * per["none"] + counts["selective"] * per["selective"] + full_units * per["full"]
    working = per["none"]  # the activation gradients of the layer in backward
    if counts["full"]:
        unit = rc.num_layers if (rc.kind == "full" and rc.method == "uniform") else 1
        working += unit * per["none"]
    elif counts["selective"]:
        working += per["none"] - per["selective"]
    w, g, o = STATE_BYTES[precision]
    params = stage_params(model, layout, stage)
    shard = layout.dp if layout.data_parallel == "fsdp" else 1
    parts = {"weights": params * w / shard, "gradients": params * g / shard, "optimizer": params * o / shard}
    if shard > 1:
        parts["fsdp_unsharded"] = FSDP_UNSHARDED_LAYERS * layer_params(model, layout.tp) * (2 + 4)
    parts["activations"] = held * inflight_layers(layout, n_micro, stage)
    parts["outside_layers"] = sum(outside_terms(model, layout, precision, n_micro, stage).values())
    parts["backward_transient"] = working
    parts["workspace"] = WORKSPACE_BYTES + FRAGMENTATION * sum(parts.values())
    return parts


def memory_per_gpu(model: GPTConfig, layout: Layout, capacity: float, global_batch: int,
                   precision: str = "bf16") -> Memory:
    """Bytes per GPU by part on the busiest pipeline stage (the first, or the last for small p)."""
    if precision not in STATE_BYTES:
        raise ValueError(f"precision must be one of {sorted(STATE_BYTES)}, got {precision!r}")
    n_micro = micro_batches(layout, global_batch)
    stages = {0} | {layout.pp - 1}
    best = max(((_stage_memory(model, layout, n_micro, r, precision), r) for r in stages),
               key=lambda pr: sum(pr[0].values()))
    return Memory(best[0], capacity, best[1])
