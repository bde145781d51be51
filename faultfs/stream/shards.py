"""Shards: expand stream sources (paths, URLs, globs) into an ordered list and open one shard.

Shards are read through ``faultfs.sources``, like the mount: every read is pinned to the
version the shard had when it was opened (a shard rewritten mid-stream fails the read, never
mixing versions), transient errors are retried a bounded number of times, and secrets never
reach messages.

Invariants:
- Expansion keeps the order the sources were given; each glob expands to its matches in
  sorted order. The resulting index of a shard is the ``shard_id`` of a StreamCoordinate, so
  the same sources must expand to the same list when a stream resumes.
- Expansion lists directories (for globs) but never opens or reads a shard; a shard is opened
  only when the stream reaches it, so resuming at shard k opens nothing before k.
- The format of a shard comes from its suffix: .jsonl/.ndjson/.txt are line shards, .parquet/.pq
  are Parquet shards; anything else is refused before any reading starts.
"""

from __future__ import annotations

import errno
import glob
import io
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from faultfs.errors import InvalidInput, SourceError
from faultfs.sources import Source, SourceOptions, expand_sources, local_path, open_source

LINE_SUFFIXES = (".jsonl", ".ndjson", ".txt")
TEXT_SUFFIXES = (".txt",)  # line shards whose parsed form is one text column, not JSON
PARQUET_SUFFIXES = (".parquet", ".pq")


class ShardFile(io.RawIOBase):
    """A read-only, seekable file over a ``Source``: each ``read`` is one ranged read of the
    pinned version (one local ``pread``, one HTTP/S3 range request)."""

    def __init__(self, source: Source, size: int) -> None:
        super().__init__()
        self._source = source
        # a source that reads into one new bytes object saves the copy out of its buffer
        self._pread_bytes = getattr(source, "pread_bytes", None)
        self._prefetch = getattr(source, "prefetch", None)  # local files: page cache advice
        self._size = size
        self._pos = 0

    @property
    def size(self) -> int:
        """The size of the pinned version."""
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = max(0, self._size - self._pos)
        if size == 0 or self._pos >= self._size:
            return b""
        size = min(size, self._size - self._pos)
        if self._pread_bytes is not None:
            data = self._pread_bytes(self._pos, size)
        else:
            got = self._source.pread(self._pos, size)
            data = got if isinstance(got, bytes) else bytes(got)
        self._pos += len(data)
        return data

    def prefetch(self, offset: int, size: int) -> None:
        """Advise that ``[offset, offset+size)`` is read soon (a local shard's pages are read
        into the page cache in the background; nothing for other sources)."""
        size = min(size, self._size - offset)
        if self._prefetch is not None and size > 0 and offset >= 0:
            self._prefetch(offset, size)

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        if not self.closed:
            self._source.close()
        super().close()


@dataclass(frozen=True)
class Shard:
    """One source file of a stream."""

    url: str
    format: str  # "lines" or "parquet"
    options: SourceOptions = field(default_factory=SourceOptions)

    @property
    def parse_as(self) -> str:
        """How parsed batches read the records: "json", "text" or "parquet"."""
        if self.format == "parquet":
            return "parquet"
        return "text" if self.url.lower().split("?", 1)[0].endswith(TEXT_SUFFIXES) else "json"

    @property
    def path(self) -> str:
        """The shard's path (a local path, or the URL without its protocol)."""
        path = local_path(self.url)
        return path if path is not None else self.url.split("://", 1)[-1]

    def open(self) -> ShardFile:
        """Open for reading at the shard's current version."""
        try:
            source = open_source(self.url, self.options)
        except InvalidInput as err:
            if err.errno == errno.ENOENT:
                raise SourceError(f"{self.url}: no such shard") from None
            raise SourceError(f"{self.url}: cannot open shard: {err.message}") from None
        try:
            size = source.version().size
        except BaseException:
            source.close()
            raise
        return ShardFile(source, size)


def shard_format(path: str) -> str:
    lower = path.lower().split("?", 1)[0]
    if lower.endswith(LINE_SUFFIXES):
        return "lines"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise InvalidInput(
        f"{path}: unknown record format (expected {', '.join(LINE_SUFFIXES + PARQUET_SUFFIXES)})"
    )


def expand_shards(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    fs_options: Mapping[str, Any] | None = None,
) -> list[Shard]:
    """The ordered shard list of ``sources`` (``fs_options``: fsspec storage options)."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    options = SourceOptions(storage_options=dict(fs_options or {}))
    shards: list[Shard] = []
    for source in sources:
        text = os.fspath(source)
        try:
            urls = expand_sources([text], options) if glob.has_magic(text) else [text]
        except InvalidInput as err:
            if err.errno == errno.ENOENT:
                raise SourceError(f"{text}: glob matches no shard") from None
            raise
        for url in urls:
            shards.append(Shard(url, shard_format(url), options))
    if not shards:
        raise InvalidInput("a stream needs at least one source")
    return shards
