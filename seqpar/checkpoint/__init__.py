"""Checkpoints: complete-or-skipped folders written and read through ``torch.distributed.checkpoint``.

    save_load.py      save_checkpoint / load_checkpoint / load_model_only (DCP; sync or async)
    resume.py         resume_latest: the newest intact checkpoint of this run, falling back past damage
    pieces.py         each rank's pieces of the dense tensors (DCP save and load planners)
    writer.py         DCP's file writer naming the file a failure hit, checksumming this rank's shards
    files.py          the folder's life: completion marker, commit, ``latest``, keep-N, one job per dir
    integrity.py      CRC-32s of every file, shared-out verification on load
    compat.py         the same model and data: what a resume may change and what it refuses
    errors.py         CheckpointError (a ValueError) and its kinds: corrupt, mismatch, write error
    safe_metadata.py  DCP's metadata read without running code from it
    safetensors.py    the safetensors format (``seqpar export``, ``seqpar generate``)

Integrity. ``complete.json`` records every file's size and CRC-32 (each rank checksums the files
it wrote; rank 0 records them all) and the save's sequence number. Loading verifies every file
first (``checkpoint.verify``, on by default; the ranks share the files out). An automatic resume
(``checkpoint.resume=auto``) that meets a damaged or unreadable file warns once, naming it, and
uses the previous complete checkpoint; a checkpoint named explicitly fails with one line naming
the file (:class:`CheckpointCorrupt`). A resume takes the newest save (the marker's sequence
number), so a ``latest`` that could not be rewritten (a full disk just after the rename) never
sends it back to an older one; ``latest`` is advisory. A file that cannot be written fails the save
on every rank with one line naming it and "no space left on device" when the disk is full
(:class:`CheckpointWriteError`); the earlier checkpoints are untouched.

Compatibility (:mod:`seqpar.checkpoint.compat`). A resume compares the checkpoint's
``config.yaml`` with the run's: the model keys that decide the parameters (``MODEL_KEYS``) must
match, runtime keys (``RUNTIME_KEYS``: dropout, recompute, sequence_parallel, attention kernel,
dtype, ...), the parallel layout, the optimizer and the schedule may change; saved tensors the
model does not use are refused by name. A different token stream or tokenizer is refused unless
``checkpoint.allow_data_change: true``. Refusals are :class:`CheckpointMismatch`, never a fallback.
"""
from .errors import CheckpointCorrupt, CheckpointError, CheckpointMismatch, CheckpointWriteError, UnsafeCheckpoint
from .files import CheckpointDir, checkpoint_problem, complete_checkpoints, latest_checkpoint, open_checkpoint_dir
from .compat import check_compatible, data_identity
from .safe_metadata import SafeReader
from .save_load import PendingCheckpoint, load_checkpoint, load_model_only, save_checkpoint
from .resume import resume_latest

__all__ = ["CheckpointCorrupt", "CheckpointDir", "CheckpointError", "CheckpointMismatch", "CheckpointWriteError",
           "PendingCheckpoint", "SafeReader", "UnsafeCheckpoint", "check_compatible", "checkpoint_problem",
           "complete_checkpoints", "data_identity", "latest_checkpoint", "load_checkpoint", "load_model_only",
           "open_checkpoint_dir", "resume_latest", "save_checkpoint"]
