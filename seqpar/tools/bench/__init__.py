"""Side-by-side benchmarks of seqpar against Megatron-LM core and PyTorch DTensor TP.

The peers are optional (``pip install -e .[bench]``) and imported only by ``seqpar bench``.
"""
