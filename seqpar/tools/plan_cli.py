"""``seqpar plan``: :mod:`seqpar.plan.cli`'s command, plus ``--verify``, which dry-runs the chosen layout.

The planner (:mod:`seqpar.plan`) sits below the training package the dry run builds, so the
``seqpar`` command's ``plan`` comes here: the plan is made by :func:`seqpar.plan.cli.run`, and with
``--verify`` its chosen layout (the best, or ``--layout``) is dry-run next to the prediction
(:mod:`seqpar.tools.dryrun_report`), failing when the measured peak lies more than
:data:`~seqpar.tools.dryrun_check.VERIFY_TOLERANCE` from the planner's.
"""
from __future__ import annotations

import argparse
import sys

from ..config import load_run_config
from ..errors import UserError
from ..plan import cli as plan_cli
from ..plan.gpus import GPU
from .dryrun_check import VERIFY_TOLERANCE
from .dryrun_report import main as dry_run_main


def parser() -> argparse.ArgumentParser:
    """``seqpar plan``'s arguments with ``--verify``."""
    p = plan_cli.parser()
    p.add_argument("--verify", action="store_true", help="then build the chosen layout (the best, or --layout) "
                   "on fake tensors with seqpar train --dry-run --world GPUS and print it next to the prediction")
    return p


def verify_plan(config: str, overrides: list[str], world: int, gpu: GPU) -> int:
    """The planner's chosen layout (its ``seqpar train`` ``overrides`` on ``config``) dry-run on
    ``world`` ranks against ``gpu``; a measured peak more than :data:`VERIFY_TOLERANCE` from the
    planner's fails it (a :class:`UserError`, exit 2)."""
    print(f"\nverify: seqpar train {config} {' '.join(overrides)} --dry-run --world {world} --gpu {gpu.name}\n")
    try:
        cfg = load_run_config(config, overrides)
    except UserError as err:
        raise UserError(f"every rank of {world}: {err}") from err
    return dry_run_main(config, cfg, world=world, ranks=None, device="cuda", gpu=gpu, as_json=False,
                        tolerance=VERIFY_TOLERANCE)


def main(argv: list[str] | None = None) -> int:
    """``seqpar plan``: bad input raises :class:`UserError`, which the ``seqpar`` command prints as
    one line (exit 2)."""
    args = parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    planned = plan_cli.run(args)
    return verify_plan(args.config, planned.overrides, args.gpus, planned.gpu) if args.verify else planned.status


__all__ = ["main", "parser", "verify_plan"]
