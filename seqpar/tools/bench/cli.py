"""``seqpar bench``: seqpar vs Megatron-LM core vs PyTorch DTensor TP, measured in one run.

    seqpar bench [--systems seqpar,seqpar-overlap,seqpar-compiled,megatron-core,dtensor,plain]
                 [--recompute none,selective,full] [--tp 2]
                 [--seq 256 --hidden 256 --heads 8 --layers 2 --micro-batch 2 --vocab 1024]
                 [--repeats 10 --warmup 2] [--scaling] [--out bench-results]
    seqpar bench --moe [--seq 256 --hidden 256 --micro-batch 2]

Prints a Markdown table (median step time, ratio to seqpar at the same recompute mode,
tokens/s, saved bytes per layer, step-0 loss), seqpar's communication per step (SP vs plain
TP), the recompute overhead against the FLOP-count prediction, and with ``--scaling`` how time
and saved bytes grow as the sequence and hidden sizes double. Writes ``results.json`` and
``results.png`` under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

from ... import flops
from ...errors import file_error
from ...memory.units import human
from ...model.modes import RECOMPUTE_MODES
from .peer import BenchShape
from .runner import PEERS, run_spawned


def _parse(argv):
    p = argparse.ArgumentParser(prog="seqpar bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="seqpar,seqpar-overlap,seqpar-compiled,megatron-core,dtensor")
    p.add_argument("--recompute", default="none,selective,full")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--scaling", action="store_true", help="also time seqpar as s and h double (3 points each)")
    p.add_argument("--out", default="bench-results")
    p.add_argument("--moe", action="store_true", help="instead: one MoE layer step against Megatron-core's MoELayer "
                   "(--seq, --hidden, --micro-batch; 8 experts, top-2, expert width hidden)")
    args = p.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    args.recompute = [r.strip() for r in args.recompute.split(",") if r.strip()]
    bad = [s for s in args.systems if s not in PEERS] + [r for r in args.recompute if r not in RECOMPUTE_MODES]
    if bad or "seqpar" not in args.systems:
        p.error(f"unknown systems/recompute modes {bad}; systems are {sorted(PEERS)} (seqpar must be included)")
    if "plain" in args.systems and (args.tp != 1 or set(args.recompute) - {"none", "full"}):
        p.error(f"the plain peer runs on one device with recompute none or full: use --tp 1 --recompute none,full "
                f"(got --tp {args.tp} --recompute {','.join(args.recompute)})")
    return args


def _mib(n: float) -> str:
    return human(n, "MiB", suffix=False)  # a table column that names its unit


def gemm_bound_s(recompute: str, shape: BenchShape, t: int, gemm_flops: float) -> float:
    """Seconds one rank's step would take if it only ran its share of the model and recompute FLOPs
    at this machine's measured GEMM rate (the limit a step can approach)."""
    b, s, h, L, v = shape.micro_batch, shape.seq_len, shape.hidden, shape.layers, shape.vocab_size
    work = flops.model_flops(B=b, s=s, h=h, L=L, v=v)
    if recompute == "selective":
        work += L * flops.attention_core_forward_flops(B=b, s=s, h=h)
    elif recompute == "full":
        work += L * flops.layer_forward_flops(B=b, s=s, h=h)
    return work / t / gemm_flops


def comparison_table(results: list[dict], shape: BenchShape, t: int = 1, gemm_flops: float | None = None) -> str:
    tokens = shape.micro_batch * shape.seq_len
    base = {r["recompute"]: r["median"] for r in results if r["system"] == "seqpar"}
    saved_base = {r["recompute"]: r["saved_bytes_per_layer"] for r in results if r["system"] == "seqpar"}
    lines = ["| system | recompute | median ms / step | vs seqpar | x GEMM-bound | tokens/s | saved MiB / layer | "
             "vs seqpar | step-0 loss |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        bound = (f"{r['median'] / gemm_bound_s(r['recompute'], shape, t, gemm_flops):.2f}x" if gemm_flops
                 else "-")
        lines.append(f"| {r['system']} | {r['recompute']} | {r['median'] * 1e3:.1f} | "
                     f"{r['median'] / base[r['recompute']]:.2f}x | {bound} | {tokens / r['median']:,.0f} | "
                     f"{_mib(r['saved_bytes_per_layer'])} | "
                     f"{r['saved_bytes_per_layer'] / saved_base[r['recompute']]:.2f}x | {r['step0_loss']:.6f} |")
    return "\n".join(lines)


def comm_table(comm: dict, t: int) -> str:
    lines = ["| seqpar mode | calls per step | payload MiB per step | wire MiB per rank per step |", "|---|---|---|---|"]
    for mode, label in (("tp", "plain TP (all-reduce)"), ("sp", "TP + SP (all-gather / reduce-scatter)")):
        c = comm[mode]
        calls = ", ".join(f"{k} {v}" for k, v in sorted(c["calls"].items()))
        payload = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(c["bytes"].items()))
        lines.append(f"| {label} | {calls} | {payload} | {_mib(c['wire_bytes'])} |")
    return "\n".join(lines)


def overhead_table(results: list[dict], shape: BenchShape) -> str:
    """Measured recompute overhead against two FLOP predictions: the paper's Appendix A
    accounting (hardware / model FLOPs: ``1 + s/3h`` vs ``1 + s/6h`` for selective, about +33%
    for full) and the bare count of re-run forward FLOPs (``4Bs^2h`` per layer for selective,
    one layer forward for full)."""
    b, s, h, L, v = shape.micro_batch, shape.seq_len, shape.hidden, shape.layers, shape.vocab_size
    step = flops.model_flops(B=b, s=s, h=h, L=L, v=v)
    paper = {rc: flops.hardware_flops(rc, B=b, s=s, h=h, L=L, v=v) / step - 1 for rc in ("selective", "full")}
    rerun = {"selective": L * flops.attention_core_forward_flops(B=b, s=s, h=h) / step,
             "full": L * flops.layer_forward_flops(B=b, s=s, h=h) / step}
    lines = ["| system | recompute | measured overhead | paper App. A prediction | measured / App. A | "
             "re-run forward FLOPs |", "|---|---|---|---|---|---|"]
    for system in dict.fromkeys(r["system"] for r in results):
        rows = {r["recompute"]: r["median"] for r in results if r["system"] == system}
        for rc in ("selective", "full"):
            if rc in rows and "none" in rows:
                meas = rows[rc] / rows["none"] - 1
                lines.append(f"| {system} | {rc} | {meas:+.1%} | {paper[rc]:+.1%} | {meas / paper[rc]:.2f} | "
                             f"{rerun[rc]:+.1%} |")
    return "\n".join(lines)


def _chart(results: list[dict], path: Path) -> None:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("(no chart: matplotlib is not installed; pip install matplotlib)")
        return
    systems = list(dict.fromkeys(r["system"] for r in results))
    modes = list(dict.fromkeys(r["recompute"] for r in results))
    fig = Figure(figsize=(10, 4))
    for k, (key, title, scale) in enumerate((("median", "median step time (ms)", 1e3),
                                             ("saved_bytes_per_layer", "saved MiB per layer", 1 / 2**20))):
        ax = fig.add_subplot(1, 2, k + 1)
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            vals = [next((r[key] * scale for r in results if r["system"] == system and r["recompute"] == m), 0)
                    for m in modes]
            ax.bar([j + i * width for j in range(len(modes))], vals, width, label=system)
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(modes))], modes)
        ax.set_title(title)
        ax.set_xlabel("recompute")
    fig.axes[1].legend()  # its upper right is empty: the full-recompute bars are short
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.moe:
        return _moe_main(args)
    shape = BenchShape(vocab_size=args.vocab, seq_len=args.seq, hidden=args.hidden, heads=args.heads,
                       layers=args.layers, micro_batch=args.micro_batch)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # --out names a file, or a folder this user may not write
        raise file_error(f"--out {str(out)!r}", e) from e
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, CPU gloo, fp32, 1 thread/rank"
    print(f"seqpar bench: t={args.tp}, sequence parallel, {shape}\nmachine: {machine}", flush=True)
    data = run_spawned(shape, args.systems, args.recompute, tp=args.tp, repeats=args.repeats, warmup=args.warmup)
    report = {"shape": shape.__dict__, "tp": args.tp, "machine": machine, **data}
    print(f"\nmeasured GEMM rate per rank: {data['gemm_flops'] / 1e9:.1f} GFLOP/s (fp32, [b s, h] x [h, 4h/t])")
    print("\n" + comparison_table(data["results"], shape, args.tp, data["gemm_flops"]))
    print("\nseqpar communication per training step (forward + backward):\n" + comm_table(data["comm"], args.tp))
    print("\nrecompute overhead:\n" + overhead_table(data["results"], shape))
    if args.scaling:
        report["scaling"] = scaling(shape, args)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    _chart(data["results"], out / "results.png")
    print(f"\nwrote {out / 'results.json'} and {out / 'results.png'}")
    return 0


def _moe_main(args) -> int:
    """``--moe``: seqpar's MoE layer and Megatron-core's, one step each, same weights (one CPU rank)."""
    from .moe_bench import moe_bench, moe_table
    shape = dict(seq=args.seq, batch=args.micro_batch, hidden=args.hidden, ffn=args.hidden, experts=8, top_k=2)
    print(f"seqpar bench --moe: one MoE layer, {shape}, CPU, fp32, 1 thread", flush=True)
    print(moe_table(shape, moe_bench(shape, repeats=args.repeats, warmup=args.warmup)))
    return 0


def scaling(shape: BenchShape, args) -> list[dict]:
    """seqpar alone, selective recompute vs none, as s doubles and as h doubles."""
    rows = []
    print("\nscaling (seqpar, t=%d): median ms / step and saved MiB / layer" % args.tp)
    print("| s | h | none ms | selective ms | none MiB/layer | selective MiB/layer |\n|---|---|---|---|---|---|")
    points = [(shape.seq_len * 2**k, shape.hidden) for k in range(3)] + \
             [(shape.seq_len, shape.hidden * 2**k) for k in range(1, 3)]
    for s, h in points:
        sh = BenchShape(vocab_size=shape.vocab_size, seq_len=s, hidden=h, heads=shape.heads, layers=shape.layers,
                        micro_batch=shape.micro_batch)
        res = run_spawned(sh, ["seqpar"], ["none", "selective"], tp=args.tp, repeats=max(3, args.repeats // 2),
                          warmup=1)["results"]
        r = {x["recompute"]: x for x in res}
        rows.append({"s": s, "h": h, **{f"{k}_ms": v["median"] * 1e3 for k, v in r.items()},
                     **{f"{k}_saved": v["saved_bytes_per_layer"] for k, v in r.items()}})
        print(f"| {s} | {h} | {r['none']['median'] * 1e3:.1f} | {r['selective']['median'] * 1e3:.1f} | "
              f"{_mib(r['none']['saved_bytes_per_layer'])} | {_mib(r['selective']['saved_bytes_per_layer'])} |",
              flush=True)
    return rows
