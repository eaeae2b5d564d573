"""Checkpoints: complete-or-skipped folders written and read through ``torch.distributed.checkpoint``.

    save_load.py      save_checkpoint / load_checkpoint / load_model_only (DCP; sync or async)
    resume.py         resume_latest: the newest intact checkpoint of this run, falling back past damage;
                      resume_named: the one checkpoint.resume=PATH names
    pieces.py         each rank's pieces of the dense tensors (DCP save and load planners)
    writer.py         DCP's file writer naming the file a failure hit, checksumming this rank's shards
    files.py          the folder's life: completion marker, commit, ``latest``, keep-N, one job per dir
    integrity.py      CRC-32s of every file, shared-out verification on load
    compat.py         the same model and data: what a resume may change and what it refuses
    errors.py         CheckpointError (a ValueError) and its kinds: corrupt, mismatch, write error
    safe_metadata.py  DCP's metadata read without running code from it
    safetensors.py    the safetensors format (``seqpar export``, ``seqpar generate``)

What a checkpoint guarantees (integrity, fallback, compatibility on resume): docs/checkpoints.md.
"""
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointWriteError, UnsafeCheckpoint
from .files import CheckpointDir, checkpoint_problem, complete_checkpoints, latest_checkpoint, open_checkpoint_dir
from .compat import check_compatible, data_identity
from .safe_metadata import SafeReader
from .save_load import PendingCheckpoint, load_checkpoint, load_model_only, save_checkpoint
from .resume import named_checkpoint, resume_latest, resume_named, saved_global_batch

__all__ = ["CheckpointCorrupt", "CheckpointDir", "CheckpointError", "CheckpointMismatch", "CheckpointWriteError",
           "PendingCheckpoint", "SafeReader", "UnsafeCheckpoint", "check_compatible", "checkpoint_problem",
           "complete_checkpoints", "data_identity", "latest_checkpoint", "load_checkpoint", "load_model_only",
           "named_checkpoint", "open_checkpoint_dir", "resume_latest", "resume_named", "save_checkpoint",
           "saved_global_batch"]
