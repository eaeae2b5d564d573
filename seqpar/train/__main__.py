"""``python -m seqpar.train CONFIG.yaml [key=value ...]`` (the torchrun entry point).

A user-input error prints ``seqpar train: rank R: message`` and exits 2 on every rank; under
``seqpar train --nproc-per-node`` the ranks leave the line to the launcher, which prints it once.
"""
import os
import sys

from ..config.errors import run_entry_point
from .launch import LAUNCHER_ENV, main

sys.exit(run_entry_point("seqpar train", main, quiet=os.environ.get(LAUNCHER_ENV) == "1"))
