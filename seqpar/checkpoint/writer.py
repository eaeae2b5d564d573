"""DCP's file writer, plus what seqpar needs of it: the name of the file a failure hit, and the
checksums of the shard files this rank wrote.

The checksums are taken in :meth:`ChecksumWriter.write_data`, once this rank's files are written
and fsynced (on the background thread under ``checkpoint.async``), by reading them back once.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from .errors import CheckpointError, write_error
from .integrity import checksums


class ChecksumWriter(FileSystemWriter):
    """``FileSystemWriter`` that remembers the file being written (for :func:`write_error`) and
    leaves ``sums``: ``{shard file: checksum}`` of the files this rank wrote."""

    def __init__(self, path: Path):
        super().__init__(path, sync_files=True)
        self.folder = Path(path)
        self.sums: dict[str, str] = {}
        self.current: Path = self.folder
        opener = self.fs.create_stream

        @contextlib.contextmanager
        def tracked(path, mode):
            self.current = Path(path)
            with opener(path, mode) as stream:
                yield stream

        self.fs.create_stream = tracked

    def write_data(self, plan, planner):
        try:
            future = super().write_data(plan, planner)
            written = {r.storage_data.relative_path for r in future.value()}
            self.sums = checksums(self.folder, written)
        except Exception as e:
            raise (write_error(e, self.current) or e) from None
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as e:
            raise (write_error(e, self.current) or e) from None


def own_error(e: BaseException) -> BaseException:
    """A :class:`CheckpointError` carried by DCP's ``CheckpointException`` (which names every
    rank's traceback) when some rank raised one, else ``e``."""
    if isinstance(e, CheckpointException):
        for exc, _ in e.failures.values():
            if isinstance(exc, CheckpointError):
                return exc
    return e


__all__ = ["ChecksumWriter", "own_error"]
