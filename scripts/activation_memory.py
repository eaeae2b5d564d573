"""Activation memory per technique: the paper's formulas, measured bytes and a Figure 7 chart.

    python scripts/activation_memory.py [CONFIG.yaml ...] [--paper] [--measure] [--png PATH]

The same as ``seqpar memory``; see ``--help``.
"""
from __future__ import annotations

import sys

from seqpar.tools.memory_cli import main

if __name__ == "__main__":  # guard needed: --measure starts ranks with the spawn method
    sys.exit(main(sys.argv[1:]))
