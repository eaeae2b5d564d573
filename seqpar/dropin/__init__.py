"""Tensor + sequence parallelism and selective recomputation for models seqpar did not build.

    spec.py             Plan and Style (what to do), Parallelized (what was done: ``model.seqpar``)
    tensor_parallel.py  ``parallelize`` (imported as ``seqpar.parallelize``): swap a model's
                        modules for seqpar layers by a declarative plan
    modes.py            sequence parallelism on / off on a parallelized model (``set_sequence_parallel``),
                        region and gradient hooks; ``check_groups`` for hand-converted layers
    state_dict.py       ``dense_state_dict`` / ``load_dense_state_dict``: the original layout, gathered
    pretrained.py       ``save_pretrained`` / ``load_pretrained`` for Hugging Face models
    wrappers.py         ``unwrap``: the model inside ``torch.compile`` / DDP wrappers
    attention.py        ``checkpoint_attention``: RNG-exact recompute of HF attention cores
    dropout.py          dropout streams: per-TP-rank masks on shards and heads, one mask on full
                        tensors; ``replay_streams`` for ``torch.utils.checkpoint``

Import everything but ``parallelize`` and the ready plans (:mod:`seqpar.plans`) from here.
"""
from .attention import checkpoint_attention
from .dropout import replay_streams
from .modes import check_groups, set_sequence_parallel
from .pretrained import load_pretrained, save_pretrained
from .spec import KVHeads, Parallelized, Plan, Style
from .state_dict import dense_state_dict, load_dense_state_dict
from .wrappers import unwrap

__all__ = ["KVHeads", "Parallelized", "Plan", "Style", "check_groups", "checkpoint_attention", "dense_state_dict",
           "load_dense_state_dict", "load_pretrained", "replay_streams", "save_pretrained", "set_sequence_parallel",
           "unwrap"]
