"""``seqpar train CONFIG.yaml [key=value ...]`` and ``torchrun ... -m seqpar.train CONFIG.yaml ...``.

With ``--nproc-per-node N`` outside torchrun, this command starts torchrun itself (standalone
rendezvous on this machine), so one line trains on N local processes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seqpar train", description="Train a GPT model with tensor + sequence "
                                "parallelism and selective recomputation.")
    p.add_argument("config", nargs="?", help="YAML config (see configs/); omitted = built-in defaults")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50 parallel.tp=2")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start torchrun with this many local processes (ignored under torchrun)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc-per-node: restarts torchrun may make; each resumes from the latest checkpoint")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_intermixed_args(argv)
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)
        args.config = None
    from ..config import load_run_config
    try:
        cfg = load_run_config(args.config, args.overrides)  # fail fast, before any process is started
    except (ValueError, FileNotFoundError) as e:
        print(f"seqpar train: {e}", file=sys.stderr)
        return 2
    under_torchrun = "LOCAL_RANK" in os.environ
    if args.nproc_per_node and not under_torchrun:
        torchrun = shutil.which("torchrun")
        cmd = ([torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"])
        cmd += ["--standalone", f"--nproc-per-node={args.nproc_per_node}", f"--max-restarts={args.max_restarts}",
                "-m", "seqpar.train"] + ([args.config] if args.config else []) + args.overrides
        os.execvp(cmd[0], cmd)
    from .trainer import train
    try:
        train(cfg)
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
