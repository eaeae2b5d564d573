"""The text a cache is built from, in pieces another process can read on its own.

A :class:`TextInput` is a sequence of pieces (a few files, or a range of dataset records), each
small, picklable and read independently, so the cache's shards (consecutive pieces) are encoded
by several processes at once and the text is never all in memory (:mod:`seqpar.data.shards`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

from .errors import DataError

PIECE_FILES, PIECE_BYTES = 256, 4 << 20  # at most this many files / bytes in one piece of a text source


@dataclass(frozen=True)
class Document:
    """One input file of a text corpus, as listed (and fingerprinted) before reading."""

    path: Path
    nbytes: int  # bytes read from the start of the file (the last file may be cut by the cap)
    size: int
    mtime_ns: int


BAD_BYTES_MIN, BAD_BYTES_SHARE = 16, 0.001  # more undecodable bytes than both: not a text file


def read_document(doc: Document) -> str:
    """The listed prefix of ``doc`` as text. A few undecodable bytes are replaced (a cut may split a
    character, a file may hold a stray byte); more than :data:`BAD_BYTES_MIN` and
    :data:`BAD_BYTES_SHARE` of the file raise :class:`DataError` naming the file and the count."""
    with open(doc.path, "rb") as f:
        raw = f.read(doc.nbytes)
    text = raw.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - raw.count("\ufffd".encode())  # replacements, not U+FFFD in the file
    if bad > BAD_BYTES_MIN and bad > BAD_BYTES_SHARE * len(raw):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            first = e.start
        raise DataError(f"{doc.path}: {bad} undecodable sequences in {len(raw):,} bytes (the first at byte "
                        f"{first}) - not UTF-8 text; convert it to UTF-8 or leave it out of data.source")
    return text


class Piece(Protocol):
    documents: int
    nbytes: int

    def texts(self) -> Iterator[list[str]]:
        """The piece's documents, a batch at a time."""


@dataclass(frozen=True)
class FilePiece:
    """A few consecutive files of a text source, read in one batch."""

    docs: tuple[Document, ...]

    @property
    def documents(self) -> int:
        return len(self.docs)

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.docs)

    def texts(self) -> Iterator[list[str]]:
        yield [read_document(d) for d in self.docs]


@dataclass(frozen=True)
class TextInput:
    """A text source's documents in order, as pieces."""

    pieces: tuple[Piece, ...]

    @property
    def documents(self) -> int:
        return sum(p.documents for p in self.pieces)

    @property
    def nbytes(self) -> int:  # bytes of text (for the progress lines)
        return sum(p.nbytes for p in self.pieces)

    def batches(self) -> Iterator[list[str]]:
        """One pass over every document, a batch at a time."""
        for piece in self.pieces:
            yield from piece.texts()


def file_input(docs: list[Document]) -> TextInput:
    """The files of a text source, grouped into pieces of at most ``PIECE_FILES`` files and
    ``PIECE_BYTES`` bytes (a larger file is a piece of its own)."""
    pieces, group, size = [], [], 0
    for d in docs:
        if group and (len(group) == PIECE_FILES or size + d.nbytes > PIECE_BYTES):
            pieces.append(FilePiece(tuple(group)))
            group, size = [], 0
        group.append(d)
        size += d.nbytes
    if group:
        pieces.append(FilePiece(tuple(group)))
    return TextInput(tuple(pieces))
