"""The side-by-side rows (:mod:`seqpar.tools.bench.side_by_side`) as Markdown: one table of the
cells, one of each cell's top operators."""
from __future__ import annotations

from ...memory.units import human

FLOPS_NOTE = (
    "MFU and HFU: FLOPs per step over step time and the device's peak dense bf16 FLOP/s ({peak}). FLOPs are "
    "`seqpar.flops`' (the paper's Appendix A): matrix multiplies only, 2 per multiply-add, backward twice the "
    "forward; causal attention is counted as the paper counts it, the whole s x s score matrix (4Bs^2h forward "
    "per layer for QK^T and attention over V), not halved for the causal mask. Model FLOPs (MFU) are the same "
    "for every cell of a shape; hardware FLOPs (HFU) add what recompute re-runs as `FlopCounterMode` would "
    "count it: selective one more attention-core forward per layer, full one more forward of every layer; the "
    "op-level choices (norm, activation, dropout) and a fused kernel's own recompute inside its backward "
    "add no matrix FLOPs.")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _baseline(rows: list[dict], row: dict) -> dict | None:
    """The plain peer's row at ``row``'s compile setting, recompute none (the user's default)."""
    mode = "compiled" if row["compiled"] else "eager"
    return next((r for r in rows if r["status"] == "ok" and r["cell"] == f"plain/{mode}/sdpa/none"), None)


def _top(row: dict) -> str:
    ops = row.get("top_ops") or []
    return f"{ops[0]['name'][:48]} ({ops[0]['share']:.0%})" if ops else "-"


def _cell_line(rows: list[dict], r: dict) -> str:
    if r["status"] != "ok":
        what = r.get("error") or r.get("reason") or ""
        return f"| {r['cell']} | {r['status']}: {what.replace('|', '/')} | | | | | | |"
    base = _baseline(rows, r)
    ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
    peak = human(r["peak_bytes"]) if r.get("peak_bytes") is not None else "-"
    compile_s = f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
    return (f"| {r['cell']} | {r['tokens_per_s']:,.0f} | {ratio} | {_pct(r.get('mfu'))} | {_pct(r.get('hfu'))} | "
            f"{peak} | {compile_s} | {_top(r)} |")


def cells_table(rows: list[dict]) -> str:
    """One line per cell: tokens/s, the ratio to the plain peer (same compile setting, recompute
    none), MFU, HFU, peak memory, compile seconds and the top operator's share of device time; a
    failed, skipped or unstarted cell says why in the tokens/s column."""
    lines = ["| cell (system/compile/attention/recompute) | tokens/s | vs plain | MFU | HFU | peak memory | "
             "compile s | top kernel (share of device time) |", "|---|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [_cell_line(rows, r) for r in rows])


def ops_table(rows: list[dict]) -> str:
    """Each measured cell's top operators (CUDA: kernels by device time; CPU: operators by self
    host time) as ``name ms/step (share)``."""
    lines = ["| cell | top operators: ms per step (share) |", "|---|---|"]
    for r in rows:
        if r["status"] == "ok" and r.get("top_ops"):
            ops = "; ".join(f"`{o['name'][:80].replace('|', '/')}` {o['ms_per_step']:.2f} ({o['share']:.0%})"
                            for o in r["top_ops"])
            lines.append(f"| {r['cell']} | {ops} |")
    return "\n".join(lines)


def markdown(rows: list[dict], command: str = "") -> str:
    """The report: what ran, the FLOPs convention, the cells table and the top operators."""
    ok = [r for r in rows if r["status"] == "ok"]
    device = next((r["device"] for r in rows if r.get("device")), "?")
    peak = next((r.get("peak_flops") for r in ok if r.get("peak_flops")), None)
    peak_text = f"{peak / 1e12:g} TFLOP/s for {device}" if peak else f"unknown for {device}: MFU and HFU not shown"
    budget = [r for r in rows if r["status"] == "budget"]
    version = next((f", torch {r['torch']}" for r in rows if r.get("torch")), "")
    head = [f"Shape {rows[0]['shape'] if rows else '?'} on {device}{version}; {len(ok)} of {len(rows)} cells measured."]
    if command:
        head.append(f"Command: `{command}`")
    if budget:
        head.append(f"The time budget was spent: {len(budget)} cells were not started (rows marked budget).")
    stopped = [r for r in rows if r["status"] == "stopped"]
    if stopped:
        head.append(f"The run was interrupted: {len(stopped)} cells were not measured (rows marked stopped).")
    head.append(FLOPS_NOTE.format(peak=peak_text))
    head.append("vs plain: tokens/s over the plain PyTorch peer's at the same compile setting with recompute none.")
    return "\n\n".join(head + [cells_table(rows), ops_table(rows)]) + "\n"
