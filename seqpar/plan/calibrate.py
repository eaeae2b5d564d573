"""The one calibration of the time model: two GEMM constants from the paper's Table 4.

Rule: on the A100, with the datasheet figures and the stated bandwidth efficiencies of
:mod:`seqpar.plan.gpus`, choose

* ``E`` (fraction of peak inside a full wave of GEMM tiles) so that one layer of the 22B model
  (t = 8, b = 4, no SP, no recompute: Table 4's TP baseline) takes 7.7 + 11.9 = 19.6 ms forward
  and backward, and
* ``K0`` (per-tile overhead in reduction steps) so that selective recompute adds Table 4's
  13.2 - 11.9 = 1.3 ms to that layer's backward.

Nothing else is fitted: Table 4's other three rows and all of Table 5 (eight iteration times, four
MFUs) are predictions. ``python -m seqpar.plan.calibrate`` re-derives the constants and prints the
Table 4 rows predicted against measured.
"""
from __future__ import annotations

import sys
from dataclasses import replace

from .gpus import GPUS, GPU
from .layout import Layout, Recompute
from .paper import TABLE4_MS, TABLE4_SETTINGS, paper_run
from .timing import layer_times

BASELINE_S = sum(TABLE4_MS["tp"]) / 1e3                             # 19.6 ms
SELECTIVE_EXTRA_S = (TABLE4_MS["tp_selective"][1] - TABLE4_MS["tp"][1]) / 1e3  # 1.3 ms


def table4_layer(gpu: GPU, row: str) -> tuple[float, float]:
    """Predicted (forward, backward) seconds of one 22B layer for Table 4's row ``row``."""
    run = paper_run("22b")
    sp, mode = TABLE4_SETTINGS[row]
    layout = Layout(tp=8, pp=1, dp=1, micro_batch=4, sequence_parallel=sp, recompute=Recompute(mode))
    lt = layer_times(run.model, layout, gpu)
    return lt.forward, lt.backward + lt.recompute[mode]


def _bisect(f, lo: float, hi: float, steps: int = 60) -> float:
    """The root of increasing ``f`` in [lo, hi]."""
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2


def calibrate(gpu: GPU) -> tuple[float, float]:
    """(E, K0) that reproduce Table 4's TP-baseline layer time and selective-recompute overhead on ``gpu``."""
    def solve_e(k0: float) -> float:  # layer time falls as E rises
        return _bisect(lambda e: BASELINE_S - sum(table4_layer(replace(gpu, gemm_efficiency=e,
                                                                        gemm_k_overhead=k0), "tp")), 0.05, 1.0)

    def selective_extra(k0: float) -> float:
        g = replace(gpu, gemm_efficiency=solve_e(k0), gemm_k_overhead=k0)
        return sum(table4_layer(g, "tp_selective")) - sum(table4_layer(g, "tp"))

    k0 = _bisect(lambda k: selective_extra(k) - SELECTIVE_EXTRA_S, 0.0, 4096.0, steps=40)
    return solve_e(k0), k0


def main(argv: list[str] | None = None) -> int:
    gpu = GPUS["a100-80gb"]
    e, k0 = calibrate(gpu)
    print(f"calibrated on Table 4 (A100): E = {e:.4f}, K0 = {k0:.1f}  "
          f"(in use: E = {gpu.gemm_efficiency}, K0 = {gpu.gemm_k_overhead})")
    print("| Table 4 row | predicted fwd / bwd (ms) | paper fwd / bwd (ms) |\n|---|---|---|")
    for row, (f, b) in TABLE4_MS.items():
        pf, pb = table4_layer(gpu, row)
        print(f"| {row} | {1e3 * pf:.1f} / {1e3 * pb:.1f} | {f} / {b} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
