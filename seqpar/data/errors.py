"""The data package's input errors: :class:`~seqpar.errors.UserError` subclasses with one-line
messages naming the file or config key and the offending value, raised on every rank before any
collective."""
from __future__ import annotations

from ..errors import UserError


class DataError(UserError):
    """Bad training data or data configuration (a missing source, a damaged shard, a bad weight)."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the parts held


class TokenizerError(DataError):
    """A tokenizer that cannot be loaded, or that does not fit the model's vocabulary."""
