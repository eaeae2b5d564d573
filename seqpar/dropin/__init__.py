"""Tensor + sequence parallelism and selective recomputation for models seqpar did not build.

    tensor_parallel.py  Plan, Style and ``parallelize`` (published as ``seqpar.parallelize``):
                        swap a model's modules for seqpar layers by a declarative plan;
                        ``dense_state_dict`` gathers the original layout back
    plans.py            ready plans for HF GPT-2 and Llama (published as ``seqpar.plans``)
    attention.py        ``checkpoint_attention``: RNG-exact recompute of HF attention cores
    interop_gpt2.py     HF GPT-2 <-> seqpar's GPT weights (published as ``seqpar.interop.gpt2``)

Import ``Plan``, ``Style``, ``Parallelized``, ``dense_state_dict`` and ``checkpoint_attention``
from here, and ``parallelize``, the plans and the GPT-2 conversion from their published paths.
"""
from .attention import checkpoint_attention
from .tensor_parallel import Parallelized, Plan, Style, dense_state_dict

__all__ = ["Parallelized", "Plan", "Style", "checkpoint_attention", "dense_state_dict"]
