"""Ready drop-in plans: ``seqpar.plans.gpt2()``, ``seqpar.plans.llama()`` (defined in
:mod:`seqpar.dropin.plans`)."""
from .dropin.plans import gpt2, llama

__all__ = ["gpt2", "llama"]
