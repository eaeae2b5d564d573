"""``seqpar verify TARGET``: does this model train identically in every parallel layout? (docs/verify.md)"""
from __future__ import annotations

import argparse
import sys

from .layouts import DEFAULT_LAYOUTS
from .run import DEFAULT_BUDGET_S, verify


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="seqpar verify",
        description="Train a shrunken copy of TARGET for a few steps in one process and in each parallel layout "
                    "on local CPU gloo ranks; compare losses, every parameter's gradient, the global gradient norm "
                    "and the dropout masks. Exit 0 only when every layout is within tolerance.")
    p.add_argument("target", help="a shipped config name or YAML file, a Hugging Face model folder or config.json, "
                                  "or module:function returning (model, plan)")
    p.add_argument("--layouts", default=None,
                   help=f"comma-separated layouts (default: {','.join(DEFAULT_LAYOUTS)}); tokens tN, nosp, cpN, ring, "
                        f"ppN, dpN, ddp, fsdp, selective, full, compile")
    p.add_argument("--json", action="store_true", help="print the report as JSON (progress lines stay on stderr)")
    p.add_argument("--time-budget", type=float, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                   help="start no layout after this many seconds; the report lists those not run (default %(default)s)")
    p.add_argument("--fp32", action="store_true", help="run in float32 (tolerance 2e-4) instead of float64 (1e-9)")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per layout (default %(default)s)")
    p.add_argument("--dropout", type=float, default=None, metavar="P",
                   help="dropout of the mask probe (default: 0.1 for seqpar's models, a drop-in model's own)")
    p.add_argument("--setup", default=None, metavar="MODULE:FUNCTION",
                   help="a function every rank calls before building the model (register custom ops, plugins)")
    p.add_argument("--no-masks", action="store_true", help="skip the dropout-mask probe")
    p.add_argument("--no-shrink", action="store_true", help="run the model at its own size (slow for real models)")
    p.add_argument("--quiet", action="store_true", help="no progress line per layout")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    report = verify(args.target, args.layouts, dtype="float32" if args.fp32 else "float64", steps=args.steps,
                    time_budget=args.time_budget, masks=not args.no_masks, progress=not args.quiet,
                    shrink=not args.no_shrink, dropout=args.dropout, setup=args.setup)
    print(report.to_json() if args.json else report.text(), file=sys.stdout)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
