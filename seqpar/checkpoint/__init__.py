"""Checkpoints: complete-or-skipped folders written and read through ``torch.distributed.checkpoint``.

    save_load.py      save_checkpoint / load_checkpoint / load_model_only (DCP; sync or async)
    pieces.py         each rank's pieces of the dense tensors (DCP save and load planners)
    files.py          the folder's life: completion marker, commit, ``latest``, keep-N, one job per dir
    safe_metadata.py  DCP's metadata read without running code from it
    safetensors.py    the safetensors format (``seqpar export``, ``seqpar generate``)
"""
from .files import CheckpointDir, checkpoint_problem, complete_checkpoints, latest_checkpoint, open_checkpoint_dir
from .safe_metadata import SafeReader
from .save_load import PendingCheckpoint, load_checkpoint, load_model_only, save_checkpoint

__all__ = ["CheckpointDir", "PendingCheckpoint", "SafeReader", "checkpoint_problem", "complete_checkpoints",
           "latest_checkpoint", "load_checkpoint", "load_model_only", "open_checkpoint_dir", "save_checkpoint"]
