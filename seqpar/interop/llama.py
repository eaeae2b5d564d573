"""Hugging Face Llama <-> seqpar GPT: ``from_hf``, ``to_hf`` (defined in
:mod:`seqpar.dropin.interop_llama`)."""
from ..dropin.interop_llama import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]
