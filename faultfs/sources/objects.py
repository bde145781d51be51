"""What a remote backend reports about an object, and the protocol every backend reader follows.

An ``ObjectReader`` is one object on one backend: ``stat()`` tells its identity now, and
``read(pin, start, end)`` returns exactly those bytes of the pinned version or raises a
``faultfs.sources.retry.Failure``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from faultfs.sources.base import SourceVersion


@dataclass(frozen=True)
class ObjectStat:
    """An object's identity at one moment: size, version token and what pins a read to it."""

    size: int
    token: str  # "vid:<id>", "etag:<etag>", "lastmod:<date>", "<field>:<value>", "unpinned"
    mtime: float
    etag: str = ""  # as the server sends it, quotes included
    version_id: str = ""
    last_modified: str = ""  # HTTP date, for If-Unmodified-Since

    @property
    def version(self) -> SourceVersion:
        return SourceVersion(self.size, self.token)


class ObjectReader(Protocol):
    """One object on one backend. Raises only ``Failure`` subclasses."""

    def stat(self) -> ObjectStat: ...

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes: ...


def content_range(value: str) -> tuple[int | None, int | None]:
    """(first byte, total size) of ``bytes a-b/total`` or ``bytes */total``; None where absent."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", value or "")
    if not m:
        return None, None
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return first, total


def status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


def strong_etag(etag: str) -> bool:
    return bool(etag) and not etag.startswith("W/")


def etag_core(etag: str) -> str:
    return etag.removeprefix("W/").strip('"')

