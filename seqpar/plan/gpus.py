"""The GPUs the planner knows: datasheet figures plus the efficiency constants of the time model.

Every number is per GPU. Bandwidths are bytes per second in one direction (a ring collective
sends and receives at that rate at once). Capacities are what ``nvidia-smi`` reports as total
memory. Efficiencies are fractions of the datasheet peak that real kernels reach:

* ``gemm_efficiency`` (E) and ``gemm_k_overhead`` (K0) are the two constants calibrated once, on
  the A100, against the paper's Table 4 (see :mod:`seqpar.plan.calibrate`); H100 and H200 reuse
  them (no per-layer measurement like Table 4 is published for them).
* ``hbm_efficiency``: memory-bound kernels (LayerNorm, GeLU, softmax, dropout, the optimizer)
  stream at 80% of the HBM datasheet bandwidth (a STREAM-like copy reaches 85-90%, the fused
  elementwise kernels of a training step somewhat less). An assumption, not fitted.
* ``nvlink_efficiency``: NCCL ring collectives inside a DGX reach ~78% of the NVLink
  per-direction bandwidth as bus bandwidth (A100: ~235 of 300 GB/s). An assumption, not fitted.
* ``ib_efficiency``: large transfers over InfiniBand reach ~90% of the line rate. Not fitted.
* ``collective_latency`` and ``p2p_latency``: the fixed cost of one TP collective and of one
  exchange between pipeline stages, whatever their size. Assumptions, not fitted.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import UserError

GIB = 2**30
MIB = 2**20
GB = 10**9

# --- datasheet figures (dense bf16 tensor-core peak, no sparsity) -----------------------------
A100_PEAK_FLOPS = 312e12        # A100 SXM4, bf16 dense
A100_HBM_BYTES = 81920 * MIB    # A100 80GB: 81920 MiB
A100_HBM_BW = 2039 * GB         # HBM2e, 2039 GB/s
A100_NVLINK_BW = 300 * GB       # NVLink 3: 600 GB/s bidirectional = 300 GB/s each way
A100_IB_BW = 25 * GB            # DGX A100: one HDR 200 Gb/s NIC per GPU = 25 GB/s
A100_SMS = 108                  # streaming multiprocessors

H100_PEAK_FLOPS = 989e12        # H100 SXM5, bf16 dense
H100_HBM_BYTES = 81559 * MIB    # H100 80GB as nvidia-smi reports it
H100_HBM_BW = 3350 * GB         # HBM3, 3.35 TB/s
HOPPER_NVLINK_BW = 450 * GB     # NVLink 4: 900 GB/s bidirectional
HOPPER_IB_BW = 50 * GB          # DGX H100/H200: one NDR 400 Gb/s NIC per GPU = 50 GB/s
HOPPER_SMS = 132

H200_PEAK_FLOPS = 989e12        # H200 SXM: the H100 SXM compute die
H200_HBM_BYTES = 143771 * MIB   # H200 141GB as nvidia-smi reports it
H200_HBM_BW = 4800 * GB         # HBM3e, 4.8 TB/s

# --- efficiency constants ---------------------------------------------------------------------
# Calibrated once against Table 4 (22B layer on A100: TP baseline forward + backward 19.6 ms,
# selective recompute +1.3 ms); `python -m seqpar.plan.calibrate` re-derives them.
GEMM_EFFICIENCY = 0.774    # E: fraction of peak inside a full wave of GEMM tiles
GEMM_K_OVERHEAD = 245      # K0: per-tile prologue/epilogue cost, in reduction steps (eff K/(K+K0))
HBM_EFFICIENCY = 0.80
NVLINK_EFFICIENCY = 0.78
IB_EFFICIENCY = 0.90
FP32_SCALE = 0.5           # fp32 GEMMs run as TF32 at half the bf16 tensor-core rate (A100, H100, H200)
GEMM_TILE = (256, 128)     # output tile of the large cuBLAS bf16 kernels (rows, columns)
COLLECTIVE_LATENCY_S = 15e-6  # fixed cost of one NCCL collective inside a node (nccl-tests, small sizes)
P2P_LATENCY_S = 100e-6     # one exchange between pipeline stages: NCCL's inter-node send/recv latency
                           # (~25 us) plus the device synchronisation after each batched exchange in
                           # Megatron's schedules and the relaunch of the next chunk's kernels


@dataclass(frozen=True)
class GPU:
    """One accelerator: peak compute, memory, bandwidths and the time model's efficiencies."""

    name: str
    peak_flops: float          # dense bf16 FLOP/s
    hbm_bytes: float           # memory capacity
    hbm_bw: float              # memory bandwidth, bytes/s
    nvlink_bw: float           # intra-node bandwidth per direction, bytes/s
    ib_bw: float               # inter-node bandwidth per direction, bytes/s
    sms: int                   # units that run GEMM tiles in parallel (SMs; 1 for a CPU rank)
    gemm_efficiency: float = GEMM_EFFICIENCY
    gemm_k_overhead: float = GEMM_K_OVERHEAD
    hbm_efficiency: float = HBM_EFFICIENCY
    nvlink_efficiency: float = NVLINK_EFFICIENCY
    ib_efficiency: float = IB_EFFICIENCY
    collective_latency: float = COLLECTIVE_LATENCY_S
    p2p_latency: float = P2P_LATENCY_S
    fp32_scale: float = FP32_SCALE   # fp32 GEMM rate / bf16 rate
    tile: tuple[int, int] = GEMM_TILE

    def __post_init__(self) -> None:
        positive = {k: getattr(self, k) for k in ("peak_flops", "hbm_bytes", "hbm_bw", "nvlink_bw", "ib_bw",
                                                   "sms", "gemm_efficiency", "hbm_efficiency",
                                                   "nvlink_efficiency", "ib_efficiency", "fp32_scale")}
        bad = {k: v for k, v in positive.items() if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0)}
        if bad:
            raise UserError(f"GPU {self.name!r}: values must be finite and > 0, got {bad}")
        nonneg = {k: getattr(self, k) for k in ("gemm_k_overhead", "collective_latency", "p2p_latency")}
        bad = {k: v for k, v in nonneg.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise UserError(f"GPU {self.name!r}: values must be finite and >= 0, got {bad}")


GPUS: dict[str, GPU] = {
    "a100-80gb": GPU("a100-80gb", A100_PEAK_FLOPS, A100_HBM_BYTES, A100_HBM_BW, A100_NVLINK_BW, A100_IB_BW, A100_SMS),
    "h100-sxm": GPU("h100-sxm", H100_PEAK_FLOPS, H100_HBM_BYTES, H100_HBM_BW, HOPPER_NVLINK_BW, HOPPER_IB_BW,
                    HOPPER_SMS),
    "h200": GPU("h200", H200_PEAK_FLOPS, H200_HBM_BYTES, H200_HBM_BW, HOPPER_NVLINK_BW, HOPPER_IB_BW, HOPPER_SMS),
}
CUSTOM_DEFAULT_HBM_TBPS = A100_HBM_BW / 1e12  # --gpu custom without --hbm-tbps
CUSTOM_DEFAULT_SMS = A100_SMS


def custom_gpu(*, peak_tflops: float, hbm_gib: float, nvlink_gbps: float, ib_gbps: float,
               hbm_tbps: float = CUSTOM_DEFAULT_HBM_TBPS, sms: int = CUSTOM_DEFAULT_SMS) -> GPU:
    """A GPU from its figures: peak dense TFLOP/s, memory GiB, NVLink and InfiniBand GB/s (gigabytes
    per second, per GPU, one direction), HBM TB/s. Efficiencies are the A100-calibrated ones."""
    values = {"--peak-tflops": peak_tflops, "--hbm-gib": hbm_gib, "--nvlink-gbps": nvlink_gbps,
              "--ib-gbps": ib_gbps, "--hbm-tbps": hbm_tbps, "--sms": sms}
    bad = {k: v for k, v in values.items() if v is None or not math.isfinite(v) or v <= 0}
    if bad:
        raise UserError(f"--gpu custom needs positive finite values, got {bad}")
    return GPU("custom", peak_tflops * 1e12, hbm_gib * GIB, hbm_tbps * 1e12, nvlink_gbps * GB, ib_gbps * GB, int(sms))


def get_gpu(name: str) -> GPU:
    """The table entry for ``name`` (case-insensitive); ``custom`` needs :func:`custom_gpu`."""
    key = name.lower()
    if key not in GPUS:
        raise UserError(f"unknown GPU {name!r}; expected one of {sorted(GPUS) + ['custom']}")
    return GPUS[key]


