"""Hugging Face <-> seqpar: weight converters and the checkpoint commands (``transformers`` imported lazily).

    gpt2.py       ``from_hf`` / ``to_hf``: GPT2LMHeadModel <-> seqpar's GPT (config and dense weights)
    llama.py      ``from_hf`` / ``to_hf``: LlamaForCausalLM <-> seqpar's GPT
    export.py     ``seqpar export``: a checkpoint -> a Hugging Face folder or a safetensors file
    hf_import.py  ``seqpar import``: a Hugging Face folder on disk -> step 0 of a seqpar checkpoint
"""
from . import gpt2, llama

__all__ = ["gpt2", "llama"]
