"""The time model's MoE layer: its GEMMs, its memory-bound row permutations and its all-to-alls.

Per MoE layer and micro-batch on one GPU routing ``n`` tokens (``s b / t`` under SP, ``s b``
without: every TP rank then routes all of them alike), each to ``k`` of ``E`` experts of width
``f`` (``f/t`` under expert-TP, whose ranks see the TP group's ``t n`` tokens under SP):

* GEMMs: the router ``[n, h] x [h, E]`` in fp32 (autocast is off around it); the routed rows,
  ``m = n k`` on average under an even load whatever ``ep``, through fc1 ``[m, h] x [h, 2f]``
  (SwiGLU; ``f`` GeLU) and fc2 ``[m, f] x [f, h]``, the grouped GEMM over this rank's ``E/ep``
  experts timed as one product of ``m`` rows; the shared experts as a TP-split dense MLP of width
  ``shared x f``. So the FLOPs are :func:`seqpar.flops.moe_ffn_forward_flops`' (router, ``k``
  experts per token, the shared ones), as the Trainer counts them.
* Memory-bound: the activation function on ``m`` rows of ``f`` (plus the shared experts'), and the
  rows moved ``h`` elements at a time: the sort gather, the ``index_copy`` back and the weighted
  sum's read, 5 ``m h a`` each way; under ep the reorder to expert-major order and back, 4 more.
* TP collectives: an MoE FFN is TP-split only through its shared experts or under expert-TP; else
  only the attention half of the layer communicates over TP.
* All-to-alls over ep (:func:`expert_comm`): forward the counts (``E`` int64, a latency) and the
  rows out (dispatch) and back (combine); backward the rows both ways again; each
  :func:`seqpar.memory.moe.all_to_all_wire_bytes` leaving the rank, exposed (nothing overlaps them),
  plus ``GPU.collective_latency``. The ep group's ranks lie ``t`` apart within dp x cp, so it stays
  on NVLink while ``t x ep`` fits a node and crosses InfiniBand beyond. A full recompute repeats
  the forward's two (it is the whole forward again).
"""
from __future__ import annotations

from ..memory.moe import all_to_all_wire_bytes
from ..model.config import GPTConfig
from . import dims
from .gpus import GPU
from .kernels import gemm_fwd_bwd, link_bandwidth
from .layout import Layout

Gemm = tuple[float, float, float]


def expert_shards(model: GPTConfig, layout: Layout) -> float:
    """What FSDP2 over edp divides one rank's routed experts by. It shards each expert weight
    ``[E/ep, ...]`` along its experts and pads them to a multiple of edp, so the busiest rank holds
    ``ceil((E/ep) / edp)`` whole experts: ``edp`` when it divides ``E/ep``, less otherwise (Mixtral's
    8 experts at ep=8 over edp=8: every rank holds one whole expert, a divisor of 1)."""
    local = model.moe.experts // layout.ep
    return local / -(-local // layout.edp)


def _tokens(model: GPTConfig, layout: Layout) -> tuple[int, int, int]:
    """(tokens this rank routes, tokens its experts see per slot, each expert's width on this rank)."""
    s, b, t = model.seq_len // layout.cp, layout.micro_batch, layout.tp
    n = s * b // (t if layout.sequence_parallel else 1)
    etp = model.moe.expert_tp and t > 1
    n_in = n * t if etp and layout.sequence_parallel else n
    f = model.moe.expert_ffn(model.ffn_hidden)
    return n, n_in, f // t if etp else f


def moe_gemms(model: GPTConfig, layout: Layout, gpu: GPU, peak_scale: float) -> tuple[list[Gemm], int | None]:
    """(forward, input-gradient, weight-gradient) seconds of one MoE FFN's GEMMs, and the index of
    the TP column layer among them (shared fc1, or the experts' fc1 under expert-TP; None: neither)."""
    moe, h, t = model.moe, model.hidden, layout.tp
    n, n_in, fe = _tokens(model, layout)
    gated = 2 if model.mlp == "swiglu" else 1
    m = n_in * moe.top_k
    router = gemm_fwd_bwd(gpu, n, moe.experts, h, 1, gpu.fp32_scale)
    out = [router, gemm_fwd_bwd(gpu, m, gated * fe, h, 1, peak_scale), gemm_fwd_bwd(gpu, m, h, fe, 1, peak_scale)]
    column = 1 if moe.expert_tp and t > 1 else None
    if moe.shared_experts:
        sb, fs = model.seq_len // layout.cp * layout.micro_batch, moe.shared_experts * moe.expert_ffn(model.ffn_hidden)
        out += [gemm_fwd_bwd(gpu, sb, gated * fs // t, h, 1, peak_scale),
                gemm_fwd_bwd(gpu, sb, h, fs // t, 1, peak_scale)]
        column = 3
    return out, column


def moe_elementwise(model: GPTConfig, layout: Layout, u: int) -> tuple[float, float]:
    """(elements of the activation-function region, bytes of row permutations each way) of one MoE FFN."""
    moe = model.moe
    n, n_in, fe = _tokens(model, layout)
    m = n_in * moe.top_k
    shared = model.seq_len // layout.cp * layout.micro_batch * moe.shared_experts * moe.expert_ffn(model.ffn_hidden)
    moves = 5 + (4 if layout.ep > 1 else 0)
    return float(m * fe + shared / layout.tp), float(moves * m * model.hidden * u)


def expert_comm(model: GPTConfig, layout: Layout, gpu: GPU, u: int, gpus_per_node: int) -> tuple[float, float]:
    """Exposed (forward, backward) seconds of one MoE layer's all-to-alls over ep (module docstring)."""
    if layout.ep == 1:
        return 0.0, 0.0
    cfg = dims.with_sequence_parallel(model, layout.sequence_parallel)
    wire = all_to_all_wire_bytes(cfg, s=model.seq_len // layout.cp, b=layout.micro_batch, t=layout.tp, act=u,
                                 ep=layout.ep)
    one = float(wire) / link_bandwidth(gpu, intra_node=layout.tp * layout.ep <= gpus_per_node) + gpu.collective_latency
    return 2 * one + gpu.collective_latency, 2 * one
