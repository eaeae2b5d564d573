"""Hugging Face GPT-2 <-> seqpar GPT: ``from_hf``, ``to_hf`` (defined in
:mod:`seqpar.dropin.interop_gpt2`)."""
from ..dropin.interop_gpt2 import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]
