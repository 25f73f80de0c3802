"""The video or image a call uploads: a path, bytes or a binary file object, read in chunks.

A `MediaSource` knows its size and sha256 before the first chunk goes out (the header carries
both), and can be streamed again from the start, so a retried call re-sends the same bytes. A
path is hashed in one pass and re-opened per upload (never held in memory whole); a seekable file
object is hashed and rewound; anything else is read into memory once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TypeAlias

CHUNK_BYTES = 1 << 20
"""Bytes per `media_chunk` message (the servers' message limit is 4 MiB)."""


class MediaSource:
    num_bytes: int
    sha256: str

    def __init__(self, media: Media, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        self._data: bytes | None = None
        self._path: Path | None = None
        self._file: BinaryIO | None = None
        self._start = 0
        if isinstance(media, MediaSource):  # already hashed: share its bytes or path
            self._data, self._path, self._file, self._start = (
                media._data,
                media._path,
                media._file,
                media._start,
            )
            self.num_bytes, self.sha256 = media.num_bytes, media.sha256
            return
        if isinstance(media, (bytes, bytearray, memoryview)):
            self._data = bytes(media)
        elif isinstance(media, (str, Path)):
            self._path = Path(media)
            if self._path.is_dir():  # "no such file" would send the user looking for a missing one
                raise IsADirectoryError(f"{self._path} is a directory; pass a video or image file")
            if not self._path.is_file():
                raise FileNotFoundError(f"no such video file: {self._path}")
        elif hasattr(media, "read"):
            if _seekable(media):
                self._file, self._start = media, media.tell()
            else:
                self._data = media.read()
        else:
            raise TypeError(
                f"media must be a path, bytes or a binary file object, not {type(media).__name__}"
            )
        digest = hashlib.sha256()
        self.num_bytes = 0
        for chunk in self.chunks():
            digest.update(chunk)
            self.num_bytes += len(chunk)
        self.sha256 = digest.hexdigest()

    def chunks(self) -> Iterator[bytes]:
        """The bytes from the start, `chunk_bytes` at a time; may be called again."""
        if self._data is not None:
            for i in range(0, len(self._data), self.chunk_bytes):
                yield self._data[i : i + self.chunk_bytes]
        elif self._path is not None:
            with self._path.open("rb") as f:
                yield from _read_chunks(f, self.chunk_bytes)
        else:
            assert self._file is not None
            self._file.seek(self._start)
            yield from _read_chunks(self._file, self.chunk_bytes)


Media: TypeAlias = str | Path | bytes | bytearray | memoryview | BinaryIO | MediaSource
"""A video or image: a path, bytes, a binary file object, or an already hashed MediaSource."""


def _seekable(f) -> bool:
    try:
        return bool(f.seekable())
    except (AttributeError, OSError):
        return False


def _read_chunks(f: BinaryIO, chunk_bytes: int) -> Iterator[bytes]:
    while chunk := f.read(chunk_bytes):
        yield chunk
