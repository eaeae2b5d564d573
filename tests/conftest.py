import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
torch.set_num_threads(1)


@pytest.fixture
def spawn(tmp_path):
    """``spawn(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks
    (:func:`seqpar.distributed.local.run_local`) and returns each rank's result in rank order."""
    from distributed_harness import run_ranks

    def _spawn(fn, world_size, *args):
        return run_ranks(fn, world_size, tmp_path, *args)

    return _spawn
