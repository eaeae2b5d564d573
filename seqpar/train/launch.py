"""``seqpar train CONFIG.yaml [key=value ...]`` and ``torchrun ... -m seqpar.train CONFIG.yaml ...``.

With ``--nproc-per-node N`` outside torchrun, this command runs torchrun's agent in this process
(standalone rendezvous on this machine), so one line trains on N local processes. The ranks are
then this process's children: SIGTERM or Ctrl-C here is forwarded to them as it came (they save
at the next step boundary, say which signal, and exit 0, and so does this command); a second
Ctrl-C kills them at once (exit 130). A user-input error is printed once for all ranks that saw it (exit 2), without
torchrun's failure summary, with one rank as with many; a rank's internal failure keeps its
traceback (exit 1); a restart under ``--max-restarts`` names the rank that failed
(:mod:`seqpar.train.relay`).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

from ..errors import UserError

LAUNCHER_ENV = "SEQPAR_LAUNCHER"  # set for the ranks this command starts: they leave error lines to it


EXAMPLES = """examples:
  seqpar train tiny-cpu --nproc-per-node 2 train.steps=100
  seqpar train tiny-cpu --nproc-per-node 4 parallel.cp=2
  seqpar train CONFIG.yaml data.source=MY_TEXTS data.tokenizer=HF_MODEL_DIR
  torchrun --nproc-per-node 8 -m seqpar.train CONFIG.yaml parallel.tp=8

Every key with its default and what it does: docs/training.md (data sources, tokenizers and
blends: docs/data.md; checkpoints and resuming: docs/checkpoints.md)."""


def parser() -> argparse.ArgumentParser:
    """``seqpar train``'s arguments (``seqpar.tools.train_cli`` adds the dry run's)."""
    p = argparse.ArgumentParser(prog="seqpar train", description="Train a GPT model with tensor + sequence "
                                "parallelism and selective recomputation.", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config (see configs/); omitted = built-in defaults")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.steps=50 parallel.tp=2")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="start torchrun with this many local processes (ignored under torchrun)")
    p.add_argument("--show-config", action="store_true",
                   help="print the config with the overrides applied before training (the run writes its "
                        "resolved config to OUT_DIR/config.yaml either way)")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc-per-node: restarts torchrun may make; each resumes from the latest checkpoint")
    return p


def parse(arg_parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """``argv`` (default: the command line) parsed by :func:`parser` or a parser built on it; a
    first ``key=value`` is an override, not a config."""
    args = arg_parser.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    if args.config and "=" in args.config and not args.config.endswith((".yaml", ".yml")):
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def main(argv: list[str] | None = None) -> int:
    return run(parse(parser(), argv))


def run(args: argparse.Namespace) -> int:
    """Train as parsed: here, or on ``--nproc-per-node`` local ranks started through torchrun."""
    from ..config import load_run_config
    cfg = load_run_config(args.config, args.overrides)  # fail fast, before any process is started
    if args.show_config and int(os.environ.get("RANK", "0")) == 0:
        from ..config import dump
        print("config:\n" + "\n".join("  " + line for line in dump(cfg).splitlines()), flush=True)
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node must be at least 1 (got {args.nproc_per_node})")
    if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
        return _launch(args)
    _check_single_process(cfg)
    from .trainer import train
    try:
        train(cfg)
    finally:
        from ..distributed.mesh import destroy_parallel
        destroy_parallel()
    if "LOCAL_RANK" in os.environ:  # a torchrun rank whose run finished (or stopped on a signal) cleanly
        _exit_now(0)
    return 0


def _check_single_process(cfg) -> None:
    """A layout of several ranks started as one plain process: name the flag that starts them."""
    if "WORLD_SIZE" in os.environ or "LOCAL_RANK" in os.environ:
        return
    par = cfg.parallel
    need = par.tp * par.pp * par.cp * (par.dp or 1)
    if need > 1:
        layout = ", ".join(f"{k}={v}" for k, v in (("tp", par.tp), ("pp", par.pp), ("cp", par.cp), ("dp", par.dp))
                           if v not in (None, 1))
        raise UserError(f"parallel {layout} needs {need} processes, but this is one process: add "
                        f"`--nproc-per-node {need}` (or start it under torchrun)")


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: everything is saved and closed by now, and native
    threads still winding down at teardown (seen: ``terminate called without an active exception``
    in about 1 of 10 SIGTERM stops) would turn a clean stop into an abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _children() -> list[int]:
    """Pids of this process's children (the ranks the agent started); Linux /proc, else none."""
    me, pids = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            stat = Path("/proc", entry, "stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == me:
            pids.append(int(entry))
    return pids


class _Forward:
    """The launcher's SIGTERM / SIGINT: every rank is asked to stop with the signal received (both
    are the ranks' stop request, and their line names it: ``SIGINT received`` for a Ctrl-C); a second
    Ctrl-C (more than a second after the first, so one keypress reaching the whole process group
    counts once) kills the ranks and raises ``KeyboardInterrupt`` (exit 130), remembered in
    ``aborted`` so that the ranks' own ends do not turn it into a failure."""

    def __init__(self):
        self.first: float | None = None
        self.aborted = False
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        again = self.first is not None and time.monotonic() - self.first > 1.0
        if signum == signal.SIGINT and again:
            self.aborted = True
            self._send(signal.SIGKILL)
            raise KeyboardInterrupt
        self.first = self.first if self.first is not None else time.monotonic()
        self._send(signum)

    @staticmethod
    def _send(sig: int) -> None:
        for pid in _children():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _launch(args) -> int:
    """torchrun's agent in this process: ``--standalone`` with ``args.nproc_per_node`` ranks."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from .relay import RestartNotices, report_failures
    os.environ[LAUNCHER_ENV] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its banner
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # seqpar.train.relay says it
    # SIGTERM and SIGINT are _Forward's, not torchrun's (which would end in its SignalException)
    targs = parse_args(["--standalone", "--signals-to-handle=SIGHUP,SIGQUIT", f"--nproc-per-node={args.nproc_per_node}",
                        f"--max-restarts={args.max_restarts}", "-m", "seqpar.train"]
                       + ([args.config] if args.config else []) + args.overrides)
    forward, restarts = _Forward(), RestartNotices(args.nproc_per_node).install()
    try:
        run(targs)
    except ChildFailedError as e:
        if forward.aborted:  # ranks ended by the second Ctrl-C: the interrupt, not their failure
            raise KeyboardInterrupt from None
        return report_failures(e.failures, args.nproc_per_node)
    except BaseException:
        if forward.aborted:
            raise KeyboardInterrupt from None
        raise
    finally:
        restarts.remove()
        forward.restore()
    if forward.aborted:
        raise KeyboardInterrupt
    return 0
