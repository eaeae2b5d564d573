"""The text a cache is built from, in pieces another process can read on its own.

A :class:`TextInput` is a sequence of pieces (a few files, or a range of dataset records), each
small, picklable and read independently, so the cache's shards (consecutive pieces) are encoded
by several processes at once and the text is never all in memory (:mod:`seqpar.data.shards`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol

PIECE_FILES, PIECE_BYTES = 256, 4 << 20  # at most this many files / bytes in one piece of a text source


@dataclass(frozen=True)
class Document:
    """One input file of a text corpus, as listed (and fingerprinted) before reading."""

    path: Path
    nbytes: int  # bytes read from the start of the file (the last file may be cut by the cap)
    size: int
    mtime_ns: int


def read_document(doc: Document) -> str:
    """The listed prefix of ``doc`` as text (undecodable bytes replaced)."""
    with open(doc.path, "rb") as f:
        return f.read(doc.nbytes).decode("utf-8", errors="replace")  # a cut may split a character


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
