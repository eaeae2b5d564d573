"""``seqpar train``: :mod:`seqpar.train.launch`'s command, plus ``--dry-run`` (:mod:`seqpar.tools.dryrun_report`).

The dry run sits above the training package it observes, so the ``seqpar`` command's ``train``
comes here: a dry run is run here, anything else goes to :func:`seqpar.train.launch.run`
unchanged. (``python -m seqpar.train``, the torchrun entry point, knows no ``--dry-run``.)
"""
from __future__ import annotations

import argparse

from ..config import load_run_config
from ..errors import UserError
from ..train import launch


def parser() -> argparse.ArgumentParser:
    """``seqpar train``'s arguments with the dry run's group."""
    p = launch.parser()
    dry = p.add_argument_group("dry run", "build one rank of a job of --world ranks on fake tensors (no GPU, no "
                               "data), run one step and print what it holds and sends next to the planner")
    dry.add_argument("--dry-run", action="store_true", help="dry-run the config instead of training it")
    dry.add_argument("--world", type=int, help="with --dry-run: ranks of the job (GPUs)")
    dry.add_argument("--rank", type=int, action="append", help="with --dry-run: a rank to build (repeat for "
                     "more; default: the first rank of the first and of the last pipeline stage)")
    dry.add_argument("--gpu", help="with --dry-run: a GPU of seqpar plan's table; a predicted peak above its "
                     "memory fails")
    dry.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="with --dry-run: the device the run "
                     "is resolved for (train.precision auto, attention kernels; default cuda)")
    dry.add_argument("--json", action="store_true", help="with --dry-run: print JSON")
    return p


def _dry_run(args: argparse.Namespace) -> int:
    from .dryrun_report import main as dry_run_main  # imported for a dry run only: training starts without it
    if args.world is None:
        raise UserError("--dry-run needs --world N, the ranks of the job")
    try:
        cfg = load_run_config(args.config, args.overrides)
    except UserError as err:
        raise UserError(f"every rank of {args.world}: {err}") from err
    return dry_run_main(args.config or "defaults", cfg, world=args.world, ranks=args.rank, device=args.device,
                        gpu=args.gpu, as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = launch.parse(parser(), argv)
    if args.dry_run:
        return _dry_run(args)
    if args.world is not None or args.rank or args.gpu or args.json:
        raise UserError("--world, --rank, --gpu and --json go with --dry-run")
    return launch.run(args)


__all__ = ["main", "parser"]
