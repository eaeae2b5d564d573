"""``python -m seqpar.train CONFIG.yaml [key=value ...]`` (the torchrun entry point)."""
import sys

from .launch import main

sys.exit(main())
