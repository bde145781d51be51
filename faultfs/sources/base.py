"""What every transport shares: the ``Source`` protocol, source versions and options, URL kinds.

A ``Source`` answers ``version()`` (what the bytes are now) and ``pread(off, size)`` (exactly
``size`` bytes, fewer only at the end of the source). Everything blocks: callers run it on the
engine's I/O pool, never on the trio thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from faultfs.errors import InvalidInput


@dataclass(frozen=True)
class SourceVersion:
    """What identifies the bytes of a source: its size and a version token.

    Files: ``mtime_ns:<n>;ctime_ns:<n>;ino:<dev>:<ino>``; objects: ``etag:<etag>`` or
    ``vid:<version id>``.
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
    # large reads of an uncached local source skip the page cache (O_DIRECT); Config.source_direct
    local_direct: bool = True
    storage_options: dict = field(default_factory=dict, hash=False, compare=False)


class Source(Protocol):
    url: str

    def version(self) -> SourceVersion: ...

    def mtime(self) -> float: ...

    def pread(self, off: int, size: int) -> bytes | memoryview: ...

    def close(self) -> None: ...


S3_PROTOCOLS = ("s3", "s3a")
HTTP_PROTOCOLS = ("http", "https")


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


def check_url(url: str) -> None:
    """InvalidInput for a URL that cannot be parsed (the message does not repeat it: it may
    carry credentials that cannot be told apart when it does not parse)."""
    try:
        urlsplit(url).port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        scheme = url.split("://", 1)[0] if "://" in url else "?"
        raise InvalidInput(f"source URL ({scheme}://…) is not usable: {exc}") from None
