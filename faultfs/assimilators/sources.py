"""Byte sources: open a source URL, pin its version, read exact byte ranges (blocking).

A ``Source`` answers ``version()`` (what the bytes are now) and ``pread(off, size)`` (exactly
``size`` bytes, fewer only at the end of the source). Everything here blocks: callers run it
on the engine's I/O pool, never on the trio thread.

Local files (``/path``, ``file::/path``, ``file:///path``) are read with ``os.pread`` on one
descriptor. Other URLs are fsspec sources (``faultfs.assimilators.remote``), imported lazily.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import threading
from dataclasses import dataclass, field
from typing import Protocol

from faultfs.buffers import pread_full
from faultfs.errors import InvalidInput, SourceError


@dataclass(frozen=True)
class SourceVersion:
    """What identifies the bytes of a source: its size and a version token.

    Files: ``mtime_ns:<n>``; objects: ``etag:<etag>`` or ``vid:<version id>``.
    """

    size: int
    token: str

    def describe(self) -> str:
        return f"{self.size} bytes, {self.token}"

    def to_text(self) -> str:
        return f"{self.size} {self.token}"

    @classmethod
    def from_text(cls, text: str) -> SourceVersion:
        size, _, token = text.partition(" ")
        return cls(int(size), token)


@dataclass(frozen=True)
class SourceOptions:
    """How to reach remote sources; never persisted with secrets."""

    s3_region: str = ""
    s3_profile: str = ""
    s3_endpoint_url: str = ""
    anon: bool = False
    storage_options: dict = field(default_factory=dict, hash=False, compare=False)


class Source(Protocol):
    url: str

    def version(self) -> SourceVersion: ...

    def mtime(self) -> float: ...

    def pread(self, off: int, size: int) -> bytes | memoryview: ...

    def close(self) -> None: ...


S3_PROTOCOLS = ("s3", "s3a")


def url_protocol(url: str) -> str:
    """The protocol of ``url`` (of its first part, for a chained fsspec URL), lower case;
    empty for a plain path."""
    return url.split("::", 1)[0].split("://", 1)[0].lower() if "://" in url else ""


def local_path(url: str) -> str | None:
    """The local path ``url`` names (plain path, ``file::/p``, ``file:///p``), else None."""
    if url.startswith("file::"):
        return url[len("file::"):]
    if url.startswith("file://"):
        return url[len("file://"):]
    if "://" in url or "::" in url:
        return None
    return url


class LocalFileSource:
    """A regular local file, read with ``os.pread``; version = size + mtime_ns."""

    def __init__(self, url: str, path: str) -> None:
        self.url = url
        self.path = os.path.abspath(path)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise InvalidInput(f"source {url} does not exist", errno.ENOENT) from None
        except PermissionError:
            raise InvalidInput(f"source {url} is not readable (permission denied)", errno.EACCES) from None
        except OSError as exc:
            raise InvalidInput(f"source {url} cannot be opened: {exc.strerror}", exc.errno or errno.EIO) from None
        st = os.fstat(fd)
        if stat_mod.S_ISDIR(st.st_mode):
            os.close(fd)
            raise InvalidInput(f"source {url} is a directory, not a file", errno.EISDIR)
        if not stat_mod.S_ISREG(st.st_mode):
            os.close(fd)
            raise InvalidInput(f"source {url} is not a regular file")
        self._fd = fd
        self._lock = threading.Lock()
        self._stat = st
        self._pinned = (st.st_size, st.st_mtime_ns)

    def version(self) -> SourceVersion:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise SourceError(f"source {self.url} vanished: {exc.strerror}") from None
        return SourceVersion(st.st_size, f"mtime_ns:{st.st_mtime_ns}")

    def mtime(self) -> float:
        return self._stat.st_mtime

    def pread(self, off: int, size: int) -> bytes | memoryview:
        try:
            out = pread_full(self._fd, size, off)  # one read into a buffer of our own, no copy
        except OSError as exc:
            raise SourceError(
                f"reading source {self.url} [{off}, {off + size}) failed: {exc.strerror}"
            ) from None
        st = os.fstat(self._fd)  # after the read: a write during it moved mtime or size
        if (st.st_size, st.st_mtime_ns) != self._pinned:
            raise SourceError(
                f"source {self.url} changed under the mount (was {self._pinned[0]} bytes, "
                f"mtime_ns {self._pinned[1]}; now {st.st_size} bytes, mtime_ns {st.st_mtime_ns})")
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def open_source(url: str, options: SourceOptions | None = None) -> Source:
    """Open ``url`` for range reads. Raises InvalidInput when it cannot be a source."""
    path = local_path(url)
    if path is not None:
        if not path:
            raise InvalidInput("source path is empty")
        return LocalFileSource(url, path)
    try:
        from faultfs.assimilators import remote
    except ImportError as exc:  # pragma: no cover - depends on installed extras
        raise InvalidInput(f"source {url} needs fsspec support that is not installed: {exc}") from None
    return remote.open_fsspec_source(url, options or SourceOptions())


def expand_sources(patterns: list[str], options: SourceOptions | None = None) -> list[str]:
    """Expand globs (``*``, ``?``, ``[``) in sorted order; plain names pass through."""
    out: list[str] = []
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        path = local_path(pattern)
        if path is not None:
            import glob

            matches = sorted(glob.glob(path))
            prefix = pattern[: len(pattern) - len(path)]
            files = [m for m in matches if os.path.isfile(m)]
            if not files:
                raise InvalidInput(f"source glob {pattern} matches no file")
            out.extend(prefix + m for m in files)
        else:
            from faultfs.assimilators import remote

            out.extend(remote.expand_fsspec_glob(pattern, options or SourceOptions()))
    return out
