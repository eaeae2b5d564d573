"""Process groups, the paper's communication operators, RNG streams and gradient sync."""
from .comm_counter import CommCounter, count_comm
from .local import RankFailed, run_local
from .grad_sync import install_sp_grad_hooks, mark_sp_replicated, sp_replicated_parameters, sync_sp_replicated_grads
from .mesh import ParallelMesh, init_parallel
from .regions import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    gather_to_replicated,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    split_to_tp,
)
from .rng import RNGStreams, capture_rng, replay_rng, restore_rng

__all__ = [
    "CommCounter", "count_comm", "ParallelMesh", "init_parallel", "RNGStreams", "capture_rng", "replay_rng",
    "restore_rng", "copy_to_tp", "reduce_from_tp", "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp",
    "gather_to_replicated", "gather_from_tp", "split_to_tp", "mark_sp_replicated", "sp_replicated_parameters",
    "sync_sp_replicated_grads", "install_sp_grad_hooks", "run_local", "RankFailed",
]
