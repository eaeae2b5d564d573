"""``seqpar`` command line: ``seqpar train | generate | memory | bench ...``."""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("seqpar.tools.train_cli", "train a GPT model (torchrun-compatible; --nproc-per-node starts torchrun)"),
    "generate": ("seqpar.train.generate", "print a sample from a checkpoint"),
    "memory": ("seqpar.tools.memory_cli", "activation memory per technique: paper formulas and measured bytes"),
    "bench": ("seqpar.tools.bench.cli", "seqpar vs Megatron-LM core vs PyTorch DTensor, measured side by side"),
    "plan": ("seqpar.tools.plan_cli", "choose layout and recompute for a model on a cluster, predicted step time"),
    "export": ("seqpar.interop.export", "write a checkpoint as a Hugging Face model folder (--format hf)"),
    "import": ("seqpar.interop.hf_import", "convert a local Hugging Face model folder into a seqpar checkpoint"),
    "verify": ("seqpar.tools.verify.cli", "check that a model trains identically in every parallel layout"),
}


def _usage() -> str:
    lines = ["usage: seqpar COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\n'seqpar COMMAND --help' describes each command's arguments.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"seqpar: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    from .config.errors import run_entry_point
    module = importlib.import_module(COMMANDS[name][0])
    return run_entry_point(f"seqpar {name}", module.main, rest)


if __name__ == "__main__":
    sys.exit(main())
