"""Side by side on one device, in one run: seqpar's cells next to a plain PyTorch GPT and Megatron-core.

A cell is ``system/compile/attention/recompute`` (``seqpar/compiled/sdpa/selective``). The grid:

* ``seqpar``: eager / compiled x attention math / sdpa x recompute none / selective /
  ``selective+norm+activation+dropout`` (``model.recompute_ops``) / full;
* ``trainer``: the Trainer's step with fp32 master weights (eager and compiled, sdpa, selective);
* ``plain``: a GPT as a user writes it (sdpa, recompute none / full, eager and compiled);
* ``megatron-core``: its GPTModel, local spec (eager, its own math attention, none / selective / full).

Each cell is built fresh, warmed up, timed (``steps`` steps, the device synchronised around each),
profiled (:func:`top_ops`) and written as one JSON line as soon as it finishes, so a killed run
keeps its rows. A cell that fails (out of memory, an unsupported combination) becomes a row with
its error; one that cannot run here (a package missing) a row with the reason; once
``time_budget_s`` is spent the remaining cells are rows that say so.
"""
from __future__ import annotations

import fnmatch
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ... import flops
from ...errors import UserError
from ...model.modes import RECOMPUTE_MODES
from .peer import BenchShape
from .sbs_systems import SkipCell, build, model_config, split_recompute

OPS_RECOMPUTE = "selective+norm+activation+dropout"  # the fused-attention recompute choices, all three

# name -> (shape, dropout): the 1.3B shape of the GPU checks (GPT-3 XL), and a CPU smoke shape
SHAPES: dict[str, tuple[BenchShape, float]] = {
    "1.3b": (BenchShape(vocab_size=50304, seq_len=2048, hidden=2048, heads=16, layers=24, micro_batch=4,
                        dtype="bfloat16"), 0.1),
    "tiny": (BenchShape(vocab_size=256, seq_len=64, hidden=64, heads=4, layers=2, micro_batch=2), 0.1),
}


@dataclass(frozen=True)
class Cell:
    system: str     # seqpar | trainer | plain | megatron-core
    compiled: bool
    attention: str  # math | sdpa
    recompute: str  # none | selective | full, or a mode with op choices: selective+norm+activation

    @property
    def name(self) -> str:
        return f"{self.system}/{'compiled' if self.compiled else 'eager'}/{self.attention}/{self.recompute}"

    @classmethod
    def parse(cls, name: str) -> "Cell":
        parts = name.split("/")
        if len(parts) != 4 or parts[1] not in ("eager", "compiled"):
            raise UserError(f"cell {name!r} is not system/eager|compiled/attention/recompute, "
                            f"e.g. seqpar/compiled/sdpa/selective")
        return cls(parts[0], parts[1] == "compiled", parts[2], parts[3])


def grid() -> list[Cell]:
    """Every cell of the side-by-side run, in the order they run."""
    cells = [Cell("seqpar", c, a, r) for c in (False, True) for a in ("math", "sdpa")
             for r in ("none", "selective", OPS_RECOMPUTE, "full")]
    cells += [Cell("trainer", c, "sdpa", "selective") for c in (False, True)]
    cells += [Cell("plain", c, "sdpa", r) for c in (False, True) for r in ("none", "full")]
    cells += [Cell("megatron-core", False, "math", r) for r in RECOMPUTE_MODES]
    return cells


def select(cells: list[Cell], patterns: Iterable[str]) -> list[Cell]:
    """The cells whose names match any of the shell-style ``patterns`` (``seqpar/*/sdpa/*``), in
    grid order; a pattern without wildcards that names no grid cell is run as the cell it names
    (so any combination can be asked for). A pattern that selects nothing is a UserError."""
    patterns = [p for p in patterns if p]
    chosen = [c for c in cells if any(fnmatch.fnmatchcase(c.name, p) for p in patterns)]
    for p in patterns:
        if not any(fnmatch.fnmatchcase(c.name, p) for c in cells):
            if any(ch in p for ch in "*?["):
                raise UserError(f"--cells pattern {p!r} matches no cell; cells are named like "
                                f"{cells[0].name} ({len(cells)} in the grid)")
            chosen.append(Cell.parse(p))
    return chosen


@dataclass
class Options:
    steps: int = 5               # timed steps per cell
    warmup: int = 2              # untimed steps first (the first one compiles)
    profile_steps: int = 1       # steps under torch.profiler after the timed ones (0: no profile)
    compile_backend: str = "inductor"
    time_budget_s: float | None = None  # start no cell after this many seconds (the first always starts)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _batch(shape: BenchShape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1), generator=g)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def top_ops(events, steps: int, device: torch.device, n: int = 5) -> list[dict]:
    """The ``n`` entries of ``events`` (``prof.key_averages()``) taking the most self time: on CUDA
    the kernels by device time (host operators are left out: each also carries the device time of
    the kernels it launched), elsewhere the operators by host time. Each: name, milliseconds per
    step, share of all self time of its kind."""
    from torch.autograd import DeviceType
    if device.type == "cuda":
        key, events = "self_device_time_total", [e for e in events if e.device_type != DeviceType.CPU]
    else:
        key = "self_cpu_time_total"
    events = sorted((e for e in events if getattr(e, key, 0) > 0), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    return [{"name": e.key[:200], "ms_per_step": getattr(e, key) / 1e3 / steps, "share": getattr(e, key) / total}
            for e in events[:n]]


def _profile(stepper, batch, device: torch.device, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            stepper.step(*batch)
        _sync(device)
    return top_ops(prof.key_averages(), steps, device)


def _timed_steps(stepper, batch, device: torch.device, opts: Options) -> dict:
    """First step (compilation included) timed apart, then warmup, then ``opts.steps`` timed steps
    with the peak memory of those steps."""
    from ...parallel.compile import compile_seconds
    compiled_before = compile_seconds()
    _sync(device)
    t0 = time.perf_counter()
    stepper.step(*batch)
    _sync(device)
    first_s, compile_s = time.perf_counter() - t0, compile_seconds() - compiled_before
    for _ in range(max(0, opts.warmup - 1)):
        stepper.step(*batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, loss = [], None
    for _ in range(opts.steps):
        _sync(device)
        t0 = time.perf_counter()
        loss = stepper.step(*batch)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"first_step_s": first_s, "compile_s": compile_s if compile_s > 0 else None, "step_s_all": times,
            "step_s": statistics.median(times), "peak_bytes": peak,
            "loss": float(loss) if loss is not None else None}


def _flops(cell: Cell, shape: BenchShape, seconds: float, peak: float | None) -> dict:
    """Model and hardware FLOPs per step (seqpar.flops, Appendix A; see the table's header) and
    MFU / HFU against ``peak`` (None: unknown device)."""
    mode, _ = split_recompute(cell.recompute)
    cfg = model_config(shape, attention=cell.attention)
    model = flops.step_model_flops(cfg, sequences=shape.micro_batch)
    hardware = flops.config_hardware_flops(cfg, B=shape.micro_batch, recompute=mode)
    return {"model_flops": model, "hardware_flops": hardware,
            "mfu": model / seconds / peak if peak else None, "hfu": hardware / seconds / peak if peak else None}


def measure(cell: Cell, shape: BenchShape, dropout: float, device: torch.device, opts: Options) -> dict:
    """One cell, built fresh: its timings, FLOP rates, peak memory and top operators."""
    stepper = build(cell, shape, dropout, device, opts.compile_backend)
    try:
        batch = _batch(shape, device)
        row = _timed_steps(stepper, batch, device, opts)
        row["top_ops"] = _profile(stepper, batch, device, opts.profile_steps) if opts.profile_steps else []
    finally:
        stepper.close()
    peak = flops.peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    row["tokens_per_s"] = shape.micro_batch * shape.seq_len / row["step_s"]
    return row | _flops(cell, shape, row["step_s"], peak) | {"peak_flops": peak}


def _error(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return f"out of memory: {first}"
    return f"{type(e).__name__}: {first}"


def _clean(device: torch.device) -> None:
    """Free what a cell left (its model, optimizer, compiled graphs) before the next one."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    import torch._dynamo
    torch._dynamo.reset()


def run_cell(cell: Cell, shape_name: str, device: torch.device, opts: Options) -> dict:
    """One row: ``status`` ok (the measurements), skipped (``reason``) or error (``error``)."""
    shape, dropout = SHAPES[shape_name]
    row = _cell_fields(cell, shape_name) | {"device": _device_name(device), "torch": torch.__version__}
    try:
        row |= {"status": "ok"} | measure(cell, shape, dropout, device, opts)
    except SkipCell as e:
        row |= {"status": "skipped", "reason": str(e)}
    except Exception as e:  # noqa: BLE001 - a failing cell is a row, not the end of the run
        row |= {"status": "error", "error": _error(e)}
    finally:
        _clean(device)
    return row


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _cell_fields(cell: Cell, shape_name: str) -> dict:
    return {"cell": cell.name, "system": cell.system, "compiled": cell.compiled, "attention": cell.attention,
            "recompute": cell.recompute, "shape": shape_name}


def _append(out: Path, row: dict) -> None:
    with out.open("a") as f:
        f.write(json.dumps(row) + "\n")


def run(cells: list[Cell], shape_name: str, out: Path, device: torch.device, opts: Options,
        log: Callable[[str], None] = print) -> list[dict]:
    """Run ``cells`` in order, appending each row to ``out`` (JSON lines, truncated first) as it
    finishes. Once ``opts.time_budget_s`` is spent the cells not started (the first always starts)
    are rows with status ``budget``; after Ctrl-C (SIGINT) the cell running and those not started
    are rows with status ``stopped``, and the rows come back for the table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("")
    rows, start = [], time.perf_counter()
    try:
        for i, cell in enumerate(cells):
            spent = time.perf_counter() - start
            if i and opts.time_budget_s is not None and spent > opts.time_budget_s:
                row = _cell_fields(cell, shape_name) | {"status": "budget", "reason": f"not started: the time "
                                                        f"budget of {opts.time_budget_s:g} s was spent ({spent:.0f} s)"}
            else:
                row = run_cell(cell, shape_name, device, opts) | {"elapsed_s": time.perf_counter() - start}
            _append(out, row)
            rows.append(row)
            log(f"[{i + 1}/{len(cells)}] {cell.name}: {_summary(row)}")
    except KeyboardInterrupt:
        log(f"interrupted: {len(cells) - len(rows)} cells not measured")
        for cell in cells[len(rows):]:
            rows.append(_cell_fields(cell, shape_name) | {"status": "stopped", "reason": "the run was interrupted"})
            _append(out, rows[-1])
    return rows


def _summary(row: dict) -> str:
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('error') or row.get('reason')}"
    return f"{row['step_s'] * 1e3:.1f} ms/step, {row['tokens_per_s']:,.0f} tokens/s"


def read_rows(path: Path) -> list[dict]:
    """The rows of a JSON-lines file written by :func:`run` (a torn last line, from a killed run, is dropped)."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
