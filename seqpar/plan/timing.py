"""Predicted seconds per training step of a layout, and its MFU / HFU.

One layer, one micro-batch, one GPU (:func:`layer_times`):

* GEMMs (Appendix A's FLOPs, :mod:`seqpar.plan.kernels` for their speed): QKV ``[sb, h] x [h, 3h/t]``,
  projection ``[sb, h/t] x [h/t, h]``, MLP ``[sb, h] x [h, f/t]`` and ``[sb, f/t] x [f/t, h]``; the
  attention core ``b a / t`` products ``[s, d] x [d, s]`` and ``[s, s] x [s, d]``. Backward is
  each one's input and weight gradients.
* Memory-bound kernels, bytes per element (2-byte activations, 1-byte masks): LayerNorm 4 forward /
  6 backward, bias-dropout-add 7 / 5 (twice each), GeLU 4 / 6 on ``[s, b, f/t]``, softmax 4 / 6 and
  attention dropout 5 / 5 on the ``[b, a/t, s, s]`` scores. Without SP the LayerNorm and dropout
  regions are whole on every TP rank, with SP a 1/t sequence shard.
* TP communication inside the node: forward, two all-reduces (TP) or two all-gathers and two
  reduce-scatters (SP): the same bytes, always exposed. Backward as the layers implement it
  (:mod:`seqpar.layers.linear`): TP all-reduces each column layer's input gradient behind its
  weight-gradient GEMM; SP all-gathers the output gradient of each row layer (exposed), re-gathers
  the column layer's input shard behind the input-gradient GEMM and reduce-scatters the input
  gradient behind the weight-gradient GEMM. Only what outlasts the GEMM it hides behind counts,
  plus a fixed latency per exposed collective (``GPU.collective_latency``).
* Recompute: selective repeats the attention core's GEMMs, softmax and dropout; full repeats the
  whole forward, its collectives included.
* An MoE layer (:mod:`seqpar.plan.experts`): the router, ``k`` experts per token and the shared
  experts instead of the MLP, its row permutations, and four all-to-alls over ep (dispatch and
  combine, forward and backward), exposed. An MoE model's layer is the mean over its dense and MoE
  layers; the all-to-alls are reported as their own part of the step (``all_to_all``, with ep > 1).

One step (:func:`step_time`): ``n`` micro-batches at the pace of the slowest stage, the last (its
layers, the logits' GEMMs and the cross-entropy's four passes over the logits in their own dtype
(:data:`CROSS_ENTROPY_BYTES_PER_LOGIT`), 2m point-to-point exchanges of ``[s/t, b, h]`` with their
``GPU.p2p_latency``, exposed as in Megatron's schedules); the bubble, ``(p-1)/m`` of the other
stages' time per micro-batch, i.e. ``(p-1)/(m n)`` of the ideal time; the gradient all-reduce
(fp32) over the dp x cp ranks (one collective: the CP ranks' shares summed, dp averaged) minus the
backward of the last micro-batch it overlaps (DDP buckets; pipeline stages reduce after the
schedule, nothing hidden), or FSDP's per-micro-batch gathers and reduce-scatters over dp x cp
beyond the compute they overlap (an MoE model's routed experts: over their dp x cp / ep
expert-data-parallel ranks, after the rest); and the optimizer step, memory-bound at
:data:`OPTIMIZER_BYTES_PER_PARAM`. Left out: host-side launch overhead, the vocabulary-parallel
cross-entropy's small all-reduces, the embedding gradient, an MoE layer's uneven load (the time
model routes every expert ``m / E`` rows), its host read of the counts and the routing
statistics' small all-reduces, and accumulating each micro-batch's weight gradients into fp32
(fused into the weight-gradient GEMM as in the paper's implementation; seqpar's bf16 recipe adds
a separate pass).

Calibration: the two GEMM constants of :mod:`seqpar.plan.gpus` were fitted once, to Table 4 only
(:mod:`seqpar.plan.calibrate`); Table 5's eight iteration times and four MFUs are predictions.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..model.config import GPTConfig
from .. import flops
from ..memory.params import expert_params, fc1_width, layer_params, qkv_width, stage_params
from . import dims
from .gpus import GPU
from .kernels import all_reduce_seconds, gather_seconds, gemm_fwd_bwd, link_bandwidth, memory_seconds
from .experts import expert_comm, expert_shards, moe_elementwise, moe_gemms
from .layout import Layout, Mode, micro_batches
from .memory import ACTIVATION_BYTES, rebuilt_bytes

# grad-norm read 4, AdamW reads parameter, gradient, m, v (16) and writes parameter, m, v (12),
# the bf16 compute copy reads 4 and writes 2, zeroing the fp32 gradients writes 4
OPTIMIZER_BYTES_PER_PARAM = {"bf16": 4 + 28 + 6 + 4, "fp32": 4 + 28 + 4}
# the vocabulary-parallel cross-entropy (seqpar.layers.cross_entropy) reads the logits three times, in their
# own dtype (forward: max, then shift-exp-sum; backward: the softmax recomputed) and writes the gradient once:
# 4 passes of 2 (bf16) or 4 (fp32) bytes. Its fp32 work on a chunk of tokens goes through one reused 16 MiB
# buffer that stays in the L2 cache (40-50 MB on A100 / H100 / H200), so it adds no memory traffic here
CROSS_ENTROPY_BYTES_PER_LOGIT = {"bf16": 4 * 2, "fp32": 4 * 4}


def _peak_scale(gpu: GPU, precision: str) -> float:
    return gpu.fp32_scale if precision == "fp32" else 1.0


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one layer for one micro-batch on one GPU."""

    forward: float                # compute + exposed TP communication
    backward: float
    recompute: dict[Mode, float]  # extra backward time per recompute mode
    tp_comm: float                # exposed TP communication in forward + backward (part of the above)
    ep_comm: float = 0.0          # the MoE layers' all-to-alls over ep, forward + backward (part of the above)
    ep_forward: float = 0.0       # their forward share (a full recompute repeats it)


def _elementwise_bytes(model: GPTConfig, layout: Layout, u: float,
                       moe: bool = False) -> tuple[float, float, float, float]:
    """(other forward, other backward, scores forward, scores backward) bytes of memory-bound kernels
    (``moe``: an MoE layer's activation region and row permutations, :func:`moe_elementwise`)."""
    s, b, h, t = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp  # s: this CP rank's
    x = s * b * h / (t if layout.sequence_parallel else 1)   # norm / dropout / residual region
    f = s * b * model.ffn_hidden / t                         # activation-function region
    perm = 0.0
    if moe:
        f, perm = moe_elementwise(model, layout, u)
    scores = b * model.heads * s * model.seq_len / t          # this rank's queries over every key
    mask = 1 if model.dropout > 0 else 0
    amask = 1 if model.attention_dropout > 0 else 0
    act_f, act_b = ((3 * u, 5 * u) if model.mlp == "swiglu" else (2 * u, 3 * u))  # SwiGLU reads gate and up
    other_f = 2 * 2 * u * x + 2 * (3 * u + mask) * x + act_f * f + perm
    other_b = 2 * 3 * u * x + 2 * (2 * u + mask) * x + act_b * f + perm
    score_f = 2 * u * scores + amask * (2 * u + 1) * scores
    score_b = 3 * u * scores + amask * (2 * u + 1) * scores
    return other_f, other_b, score_f, score_b


def _tp_comm(layout: Layout, gpu: GPU, columns: list[tuple[float, float, float]], ag: float) -> tuple[float, float]:
    """Exposed (forward, backward) TP communication of one layer; ``columns`` are the column layers' GEMMs."""
    if layout.tp == 1:
        return 0.0, 0.0
    lat, halves = gpu.collective_latency, len(columns)  # attention, and the MLP where it is TP-split
    if not layout.sequence_parallel:  # f-bar: two all-reduces; f backward: all-reduce behind wgrad
        return halves * 2 * ag + halves * lat, sum(max(0.0, 2 * ag - wgrad) for _, _, wgrad in columns)
    backward = 0.0  # g-bar backward all-gather; re-gather behind dgrad; reduce-scatter behind wgrad
    for _, dgrad, wgrad in columns:
        backward += ag + lat + max(0.0, ag - dgrad) + max(0.0, ag - wgrad)
    return halves * 2 * ag + halves * 2 * lat, backward


_LAYER_CACHE: dict[tuple, LayerTimes] = {}


def layer_times(model: GPTConfig, layout: Layout, gpu: GPU, precision: str = "bf16",
                gpus_per_node: int = 8) -> LayerTimes:
    """Forward, backward and recompute seconds of one transformer layer (see the module docstring;
    an MoE model's: the mean over its dense and MoE layers)."""
    key = (dims.model_key(model), layout.tp, layout.micro_batch, layout.sequence_parallel, gpu, precision, layout.cp,
           repr(model.moe), layout.ep, gpus_per_node)
    if key not in _LAYER_CACHE:
        _LAYER_CACHE[key] = _layer_times(model, layout, gpu, precision, gpus_per_node)
    return _LAYER_CACHE[key]


def _context_comm(model: GPTConfig, layout: Layout, gpu: GPU, u: int, core_f: float, core_b: float) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of the CP exchange (``layout.cp_comm``). The ring: ``cp - 1``
    K/V steps forward, ``cp - 1`` K/V and ``cp`` fp32 K/V-gradient steps backward, each hidden
    behind the blocks' attention. The all-gather (pipeline stages): one all-gather of K/V forward,
    one more and a reduce-scatter of the K/V gradients backward, none hidden. The CP ranks count as
    one node's (NVLink) when ``t x cp <= 8``, else they cross InfiniBand."""
    cp, t = layout.cp, layout.tp
    if cp == 1:
        return 0.0, 0.0
    kv_heads = model.held_kv_heads(t) // t
    block = 2 * (model.seq_len // cp) * layout.micro_batch * kv_heads * model.head_dim  # K and V elements
    bw = link_bandwidth(gpu, intra_node=t * cp <= 8)
    if layout.cp_comm == "allgather":
        gather = gather_seconds(cp * block * u, cp, bw) + gpu.collective_latency
        return gather, 2 * gather
    fwd = (cp - 1) * (block * u / bw + gpu.p2p_latency)
    bwd = (cp - 1) * (block * u / bw + gpu.p2p_latency) + cp * (block * 4 / bw + gpu.p2p_latency)
    return max(0.0, fwd - core_f) + gpu.p2p_latency, max(0.0, bwd - core_b) + gpu.p2p_latency


def _layer_times(model: GPTConfig, layout: Layout, gpu: GPU, precision: str, gpus_per_node: int = 8) -> LayerTimes:
    """A dense model's layer; an MoE model's mean over its layers (dense and MoE, as the memory model)."""
    if model.moe is None:
        return _one_layer(model, layout, gpu, precision, gpus_per_node, moe=False)
    n_moe = model.moe.moe_layer_count(model.layers)
    kinds = [(w, _one_layer(model, layout, gpu, precision, gpus_per_node, moe=e))
             for e, w in ((False, model.layers - n_moe), (True, n_moe)) if w]

    def mean(get) -> float:
        return sum(w * get(lt) for w, lt in kinds) / model.layers
    return LayerTimes(mean(lambda x: x.forward), mean(lambda x: x.backward),
                      {m: mean(lambda x: x.recompute[m]) for m in kinds[0][1].recompute},
                      mean(lambda x: x.tp_comm), mean(lambda x: x.ep_comm), mean(lambda x: x.ep_forward))


def _one_layer(model: GPTConfig, layout: Layout, gpu: GPU, precision: str, gpus_per_node: int,
               moe: bool) -> LayerTimes:
    s, b, h, t = model.seq_len // layout.cp, layout.micro_batch, model.hidden, layout.tp
    sb, ps = s * b, _peak_scale(gpu, precision)
    qkv = gemm_fwd_bwd(gpu, sb, qkv_width(model, t) // t, h, 1, ps)
    proj = gemm_fwd_bwd(gpu, sb, h, h // t, 1, ps)
    ffn, column = (moe_gemms(model, layout, gpu, ps) if moe else
                   ([gemm_fwd_bwd(gpu, sb, fc1_width(model) // t, h, 1, ps),
                     gemm_fwd_bwd(gpu, sb, h, model.ffn_hidden // t, 1, ps)], 0))
    heads, d = model.heads * b // t, model.head_dim
    keys = model.seq_len  # under cp this rank's s/cp queries still see the whole sequence's keys
    scores, context = gemm_fwd_bwd(gpu, s, keys, d, heads, ps), gemm_fwd_bwd(gpu, s, d, keys, heads, ps)
    dense_f = sum(g[0] for g in [qkv, proj] + ffn)
    dense_b = sum(g[1] + g[2] for g in [qkv, proj] + ffn)
    core_f, core_b = scores[0] + context[0], scores[1] + scores[2] + context[1] + context[2]
    if layout.cp > 1:  # the CP kernel recomputes each block's scores from its log-sum-exp in backward
        core_b += scores[0]
    u = ACTIVATION_BYTES[precision]
    other_f, other_b, score_f, score_b = (memory_seconds(gpu, x) for x in _elementwise_bytes(model, layout, u, moe))
    ag = gather_seconds(s * b * h * u, t, link_bandwidth(gpu, intra_node=True))  # one [s, b, h] activation
    columns = [qkv] + ([ffn[column]] if column is not None else [])  # an MoE FFN without TP-split GEMMs: none
    comm_f, comm_b = _tp_comm(layout, gpu, columns, ag)
    cp_f, cp_b = _context_comm(model, layout, gpu, u, core_f, core_b)
    ep_f, ep_b = expert_comm(model, layout, gpu, u, gpus_per_node) if moe else (0.0, 0.0)
    comm_f, comm_b = comm_f + cp_f + ep_f, comm_b + cp_b + ep_b
    forward = dense_f + core_f + other_f + score_f + comm_f
    backward = dense_b + core_b + other_b + score_b + comm_b
    # under cp, selective is the CP kernel itself (already counted in backward): nothing more
    recompute = {"none": 0.0, "selective": core_f + score_f if layout.cp == 1 else 0.0, "full": forward}
    return LayerTimes(forward, backward, recompute, comm_f + comm_b - ep_f - ep_b, ep_f + ep_b, ep_f)


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by part, and the FLOPs it does."""

    parts: dict[str, float]  # layers, logits, p2p, bubble, data_parallel, optimizer
    model_flops: float       # per step, all GPUs (Appendix A)
    hardware_flops: float    # model FLOPs plus the recomputed forward FLOPs, as executed
    cluster_peak: float      # peak FLOP/s of all GPUs

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    @property
    def mfu(self) -> float:
        return self.model_flops / self.seconds / self.cluster_peak

    @property
    def hfu(self) -> float:
        return self.hardware_flops / self.seconds / self.cluster_peak


def _data_parallel_seconds(model: GPTConfig, layout: Layout, gpu: GPU, gpus_per_node: int,
                           mb: float, backward_mb: float, n_micro: int) -> float:
    """Exposed communication of one step over the dp x cp ranks, whose gradients are reduced in one
    collective (the CP ranks' shares summed, dp averaged): DDP's fp32 buckets all-reduced under the
    last micro-batch's backward, or after the schedule with pipeline stages (nothing hidden); or
    FSDP's gathers and fp32 reduce-scatters per micro-batch beyond the compute they overlap."""
    ranks = layout.dp * layout.cp
    if ranks == 1:
        return 0.0
    params, experts = _stage_params(model, layout)
    bw = link_bandwidth(gpu, intra_node=layout.tp * ranks <= gpus_per_node)  # an edp group spans dp x cp too
    edp = layout.edp if experts else 1
    if layout.data_parallel == "fsdp":
        per_micro = 2 * gather_seconds(2 * params, ranks, bw) + gather_seconds(4 * params, ranks, bw)
        per_micro += 2 * gather_seconds(2 * experts, edp, bw) + gather_seconds(4 * experts, edp, bw)
        first_layer = gather_seconds(2 * layer_params(model, layout.tp), ranks, bw)
        return n_micro * (max(0.0, per_micro - mb) + first_layer)
    comm = all_reduce_seconds(4 * params, ranks, bw)  # fp32 gradients
    comm += all_reduce_seconds(4 * experts, edp, bw)  # the experts' buckets, over their edp group
    if layout.pp > 1:  # the stages reduce once the schedule is done
        return comm
    return max(comm / model.layers, comm - backward_mb)


def _stage_params(model: GPTConfig, layout: Layout) -> tuple[int, int]:
    """(parameters less the routed experts, routed experts) of one GPU of the larger end stage."""
    t, p, ep = layout.tp, layout.pp, layout.ep
    return max((stage_params(model, t=t, pp=p, stage=r, ep=ep) - expert_params(model, t, pp=p, stage=r, ep=ep),
                expert_params(model, t, pp=p, stage=r, ep=ep)) for r in (0, p - 1))


def _layer_flops(model: GPTConfig, b: int) -> float:
    """Forward FLOPs of one layer for ``b`` sequences (an MoE model's: the mean over its layers)."""
    if model.moe is None:
        return flops.config_layer_forward_flops(model, B=b)
    return flops.layers_forward_flops(model, B=b) / model.layers


def step_time(model: GPTConfig, layout: Layout, gpu: GPU, global_batch: int, gpus_per_node: int = 8,
              precision: str = "bf16") -> StepTime:
    """Predicted seconds of one training step of ``layout`` (see the module docstring)."""
    n = micro_batches(layout, global_batch)
    p, m, t, b = layout.pp, layout.virtual_stages, layout.tp, layout.micro_batch
    s, h, v, u = model.seq_len // layout.cp, model.hidden, model.padded_vocab(t), ACTIVATION_BYTES[precision]
    lt = layer_times(model, layout, gpu, precision, gpus_per_node)
    counts = layout.recompute.per_stage(model.layers // (p * m), m)
    backward_mb = sum(k * (lt.backward + lt.recompute[mode]) for mode, k in counts.items())
    # model.recompute_ops: elementwise, memory-bound: each rebuilt byte read once and written once
    backward_mb += (counts["none"] + counts["selective"]) * memory_seconds(gpu, 2 * rebuilt_bytes(model, layout, precision))
    layers_mb = backward_mb + sum(counts.values()) * lt.forward
    logits = gemm_fwd_bwd(gpu, s * b, v // t, h, 1, _peak_scale(gpu, precision))
    logits_mb = sum(logits) + memory_seconds(gpu, CROSS_ENTROPY_BYTES_PER_LOGIT[precision] * s * b * v / t)
    p2p_mb = 0.0
    if p > 1:
        bw = link_bandwidth(gpu, intra_node=t * layout.cp * layout.dp * p <= gpus_per_node)
        p2p_mb = 2 * m * (s * b * h * u / t / bw + gpu.p2p_latency)
    mb = layers_mb + logits_mb + p2p_mb  # the last stage, the slowest: it sets the pace
    fsdp = layout.data_parallel == "fsdp"
    dense, experts = _stage_params(model, layout)
    params = dense / (layout.dp * layout.cp if fsdp else 1)
    params += experts / expert_shards(model, layout) if fsdp and experts else experts
    a2a_mb = sum(counts.values()) * lt.ep_comm + counts["full"] * lt.ep_forward  # the layers' all-to-alls
    parts = {"layers": n * (layers_mb - a2a_mb)} | ({"all_to_all": n * a2a_mb} if a2a_mb else {})
    parts |= {"logits": n * logits_mb, "p2p": n * p2p_mb,
              "bubble": (layers_mb + p2p_mb) * (p - 1) / m,  # filling and draining the other stages
              "data_parallel": _data_parallel_seconds(model, layout, gpu, gpus_per_node, mb, backward_mb, n),
              "optimizer": memory_seconds(gpu, params * OPTIMIZER_BYTES_PER_PARAM[precision])}
    layer, core = _layer_flops(model, b), flops.config_core_forward_flops(model, B=b)
    per_micro = flops.config_model_flops(model, B=b, t=t)
    recomputed = p * (counts["selective"] * core + counts["full"] * layer)
    steps = n * layout.dp  # micro-batches of b sequences per step, all pipelines
    return StepTime(parts, per_micro * steps, (per_micro + recomputed) * steps, gpu.peak_flops * layout.gpus)
