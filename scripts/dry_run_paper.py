"""The paper's four layouts (Table 3, configs/paper/) dry-run at full scale: one table of ratios.

    python scripts/dry_run_paper.py [--models 22b,175b,530b,1t] [--gpu a100-80gb]

For each model, the first rank of the first and of the last pipeline stage is built and stepped
on fake tensors (``seqpar train paper/NAME --dry-run --world GPUS``); each row is measured over
the planner's prediction for the training state and the saved activations, with the wall time
and the peak RSS of the rank. ``docs/dry-run.md`` shows its output.
"""
from __future__ import annotations

import argparse
import sys

from seqpar.config import load_run_config
from seqpar.plan.paper import paper_run
from seqpar.tools.dryrun_report import dry_run

PARTS = ("parameters", "gradients", "optimizer", "activations", "outside_layers")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="22b,175b,530b,1t", help="comma-separated paper models")
    p.add_argument("--gpu", default="a100-80gb", help="the GPU of the planner's table")
    args = p.parse_args(argv)
    print("| model | rank | GPUs | " + " | ".join(PARTS) + " | peak GiB | fits | wall s | RSS MiB |")
    print("|---|---|---:|" + "---:|" * (len(PARTS) + 4))
    for name in args.models.split(","):
        gpus = paper_run(name).gpus
        for _, r, check in dry_run(load_run_config(f"paper/{name}"), gpus, gpu=args.gpu):
            ratio = {k: m / planned for k, m, planned in check.rows if m is not None}
            fits = "yes" if check.capacity is None or check.peak <= check.capacity else "NO"
            print(f"| {name.upper()} | {r.rank} | {gpus} | " + " | ".join(f"{ratio[k]:.3f}" for k in PARTS)
                  + f" | {check.peak / 2**30:.1f} | {fits} | {r.seconds:.0f} | {r.peak_rss / 2**20:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
