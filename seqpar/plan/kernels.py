"""Time of the time model's three kinds of work on one GPU: GEMMs, memory-bound kernels, ring collectives.

GEMM: ``2 M N K`` FLOPs for an ``[M, K] x [K, N]`` product (times a batch), at the GPU's peak times
three factors:

* ``E`` (:data:`~seqpar.plan.gpus.GEMM_EFFICIENCY`): what a full wave of tiles reaches;
* wave quantization: the output is cut into 256 x 128 tiles run ``sms`` at a time, and a partly
  filled last wave takes as long as a full one: ``waves / ceil(waves)`` with ``waves = tiles /
  sms`` (a partly filled edge tile is not charged extra). No constant is fitted here: the tile
  and the SM count are the hardware's;
* reduction length: a tile spends a fixed prologue/epilogue, worth ``K0`` steps of its K loop,
  besides its ``K`` steps: ``K / (K + K0)``. This is what makes the attention-core GEMMs (K =
  head dim) slow and the wide projections fast.

and never faster than streaming its operands and result through HBM once (2-byte elements): the
attention-core products, with a head dim of 64-160 FLOPs per byte, sit at that roofline.

Memory-bound kernels: bytes moved / (HBM bandwidth x ``hbm_efficiency``).
Collectives: a ring all-gather or reduce-scatter of a ``total``-byte tensor over ``n`` ranks moves
``(n - 1) / n x total`` bytes through each link; an all-reduce is the two in turn.
"""
from __future__ import annotations

import math

from .gpus import GPU


def gemm_seconds(gpu: GPU, m: int, n: int, k: int, batch: int = 1, peak_scale: float = 1.0) -> float:
    """Seconds for ``batch`` products ``[m, k] x [k, n]`` (output ``[m, n]``, reduction over ``k``).

    ``peak_scale`` scales the peak (0.5 models fp32 GEMMs as TF32 at half the bf16 rate).
    """
    if min(m, n, k, batch) < 1:
        raise ValueError(f"GEMM dimensions must be >= 1, got m={m}, n={n}, k={k}, batch={batch}")
    tm, tn = gpu.tile
    waves = math.ceil(m / tm) * math.ceil(n / tn) * batch / gpu.sms
    efficiency = gpu.gemm_efficiency * waves / math.ceil(waves) * k / (k + gpu.gemm_k_overhead)
    compute = 2.0 * m * n * k * batch / (gpu.peak_flops * peak_scale * efficiency)
    return max(compute, memory_seconds(gpu, 2.0 * batch * (m * k + k * n + m * n)))


def gemm_fwd_bwd(gpu: GPU, m: int, n: int, k: int, batch: int = 1,
                 peak_scale: float = 1.0) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) seconds of a product ``Y[m, n] = X[m, k] W[k, n]``.

    The input gradient ``dX[m, k]`` reduces over n, the weight gradient ``dW[k, n]`` over m: the
    forward's FLOPs twice, each with its own shape.
    """
    return (gemm_seconds(gpu, m, n, k, batch, peak_scale), gemm_seconds(gpu, m, k, n, batch, peak_scale),
            gemm_seconds(gpu, k, n, m, batch, peak_scale))


def memory_seconds(gpu: GPU, n_bytes: float) -> float:
    """Seconds to stream ``n_bytes`` through HBM in memory-bound kernels."""
    return n_bytes / (gpu.hbm_bw * gpu.hbm_efficiency)


def link_bandwidth(gpu: GPU, intra_node: bool) -> float:
    """Achieved bytes/s per direction: NVLink inside a node, InfiniBand across nodes."""
    return gpu.nvlink_bw * gpu.nvlink_efficiency if intra_node else gpu.ib_bw * gpu.ib_efficiency


def gather_seconds(total_bytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-gather (or reduce-scatter) of a tensor of ``total_bytes`` over ``ranks`` ranks."""
    return 0.0 if ranks == 1 else (ranks - 1) / ranks * total_bytes / bandwidth


def all_reduce_seconds(total_bytes: float, ranks: int, bandwidth: float) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather."""
    return 2 * gather_seconds(total_bytes, ranks, bandwidth)
