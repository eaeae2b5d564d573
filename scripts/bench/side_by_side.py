"""seqpar side by side with a plain PyTorch GPT and Megatron-core on one device, in one run.

    python scripts/bench/side_by_side.py [--shape 1.3b|tiny] [--cells PATTERN,...] [--out sbs.jsonl]
        [--steps 5] [--warmup 2] [--profile-steps 1] [--time-budget-s 420] [--compile-backend inductor]
        [--device cuda|cpu] [--table sbs.md] [--table-only]

Cells are ``system/compile/attention/recompute`` (``seqpar/compiled/sdpa/selective``; the grid is in
``seqpar.tools.bench.side_by_side``); ``--cells`` takes shell patterns (``'seqpar/*/sdpa/*,plain/*'``)
or a cell's full name. Each cell's row is appended to ``--out`` (JSON lines) as it finishes; at the
end the Markdown table (tokens/s, ratio to the plain peer, MFU, HFU, peak memory, compile seconds,
top kernels) is printed and written to ``--table`` (default: ``--out`` with ``.md``).
``--table-only`` rebuilds the table from an existing ``--out`` (a run that was stopped).
The 1.3B shape (24 layers, h 2048, 16 heads, s 2048, micro-batch 4, bf16, dropout 0.1) is sized
for under 8 minutes on one H200 with the default budget; ``--shape tiny`` is the CPU smoke.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from seqpar.tools.bench import sbs_table
from seqpar.tools.bench.side_by_side import SHAPES, Options, grid, read_rows, run, select


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="side_by_side.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="1.3b")
    p.add_argument("--cells", default="*", help="comma-separated shell patterns or cell names (default: all)")
    p.add_argument("--out", default="sbs.jsonl", help="JSON-lines file, one row per cell as it finishes")
    p.add_argument("--table", default=None, help="Markdown table file (default: --out with .md)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per cell")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per cell, the compiling one included")
    p.add_argument("--profile-steps", type=int, default=1, help="steps under torch.profiler per cell (0: none)")
    p.add_argument("--time-budget-s", type=float, default=420.0,
                   help="start no new cell after this many seconds (0: no budget)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the compiled cells")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--table-only", action="store_true", help="only rebuild the table from --out")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.profile_steps < 0:
        p.error(f"need --steps >= 1, --warmup >= 1, --profile-steps >= 0; got {args.steps}, {args.warmup}, "
                f"{args.profile_steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    out = Path(args.out)
    table = Path(args.table) if args.table else out.with_suffix(".md")
    command = "python scripts/bench/side_by_side.py " + shlex.join(argv)
    if args.table_only:
        rows = read_rows(out)
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cells = select(grid(), args.cells.split(","))
        opts = Options(steps=args.steps, warmup=args.warmup, profile_steps=args.profile_steps,
                       compile_backend=args.compile_backend, time_budget_s=args.time_budget_s or None)
        print(f"side by side: {len(cells)} cells, shape {args.shape} {SHAPES[args.shape][0]}, {device}; "
              f"rows -> {out}", flush=True)
        rows = run(cells, args.shape, out, device, opts, log=lambda line: print(line, flush=True))
    text = sbs_table.markdown(rows, command)
    table.write_text(text)
    print("\n" + text + f"\nwrote {out} and {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
