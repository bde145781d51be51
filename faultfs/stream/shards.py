"""Shards: expand stream sources (paths, URLs, globs) into an ordered list and open one shard.

Invariants:
- Expansion keeps the order the sources were given; each glob expands to its matches in
  sorted order. The resulting index of a shard is the ``shard_id`` of a StreamCoordinate, so
  the same sources must expand to the same list when a stream resumes.
- Expansion lists directories (for globs) but never opens or reads a shard; a shard is opened
  only when the stream reaches it, so resuming at shard k opens nothing before k.
- HTTP(S) URLs are never globbed (``?`` starts their query string).
- The format of a shard comes from its suffix: .jsonl/.ndjson/.txt are line shards, .parquet/.pq
  are Parquet shards; anything else is refused before any reading starts.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from faultfs.errors import InvalidInput, SourceError

LINE_SUFFIXES = (".jsonl", ".ndjson", ".txt")
PARQUET_SUFFIXES = (".parquet", ".pq")
_NO_GLOB_PROTOCOLS = {"http", "https"}


@dataclass(frozen=True)
class Shard:
    """One source file of a stream."""

    url: str  # for messages
    fs: Any  # an fsspec AbstractFileSystem
    path: str  # the path within ``fs``
    format: str  # "lines" or "parquet"

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def open(self, *, block_size: int | None = None) -> Any:
        """Open for reading; ``block_size`` asks remote file systems for uncached reads of that
        size (one range request per read) instead of their read-ahead caches."""
        kwargs: dict[str, Any] = {}
        if block_size is not None and not self.is_local:
            kwargs = {"block_size": block_size, "cache_type": "none"}
        try:
            return self.fs.open(self.path, "rb", **kwargs)
        except FileNotFoundError:
            raise SourceError(f"{self.url}: no such shard") from None
        except OSError as err:
            raise SourceError(f"{self.url}: cannot open shard: {err}") from err


def shard_format(path: str) -> str:
    lower = path.lower().split("?", 1)[0]
    if lower.endswith(LINE_SUFFIXES):
        return "lines"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    raise InvalidInput(
        f"{path}: unknown record format (expected {', '.join(LINE_SUFFIXES + PARQUET_SUFFIXES)})"
    )


def expand_sources(
    sources: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    fs_options: Mapping[str, Any] | None = None,
) -> list[Shard]:
    """The ordered shard list of ``sources``."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    options = dict(fs_options or {})
    shards: list[Shard] = []
    for source in sources:
        text = os.fspath(source)
        try:
            fs, path = fsspec.core.url_to_fs(text, **options)
        except (ValueError, ImportError) as err:
            raise InvalidInput(f"{text}: cannot use this source: {err}") from err
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        if not protocols & _NO_GLOB_PROTOCOLS and glob.has_magic(path):
            try:
                paths = sorted(p for p in fs.glob(path) if not fs.isdir(p))
            except OSError as err:
                raise SourceError(f"{text}: cannot expand glob: {err}") from err
            if not paths:
                raise SourceError(f"{text}: glob matches no shard")
        else:
            paths = [path]
        for p in paths:
            url = text if p == path else fs.unstrip_protocol(p)
            shards.append(Shard(url, fs, p, shard_format(p)))
    if not shards:
        raise InvalidInput("a stream needs at least one source")
    return shards
