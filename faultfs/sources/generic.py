"""Any other fsspec file system: ``cat_file`` by range, verified by a stat after the read.

Invariants:
- The version token is the strongest identifying field ``info()`` reports; a read is followed
  by a stat, and a changed size or token fails it (this also catches a change mid-read).
- Synchronous implementations promise no thread safety: they are called under one lock per
  file system. Async ones serialise on their own loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from fsspec.asyn import AsyncFileSystem

from faultfs.sources.filesystems import sync_lock
from faultfs.sources.objects import ObjectStat
from faultfs.sources.retry import Changed, IsDirectory, Permanent, Transient, generic_failure

T = TypeVar("T")

# info fields that identify a version, strongest first
_VERSION_FIELDS = (
    "VersionId", "generation", "ETag", "etag", "md5Hash", "md5", "checksum",
    "mtime", "LastModified", "last_modified", "updated", "modified", "created",
)
_MTIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def _as_timestamp(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


class GenericReader:
    """Any other fsspec file system: ``cat_file`` by range, verified by a stat after the read."""

    def __init__(self, fs: Any, path: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._path = path
        self._scrub = scrub
        # async implementations serialise on their own loop; sync ones promise no thread safety
        self._lock = None if isinstance(fs, AsyncFileSystem) else sync_lock(fs)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            if self._lock is None:
                return fn()
            with self._lock:
                return fn()
        except Exception as exc:
            raise generic_failure(exc, self._scrub) from None

    def stat(self) -> ObjectStat:
        def info() -> dict:
            self._fs.invalidate_cache(self._path)
            return self._fs.info(self._path)

        info_ = self._call(info)
        if info_.get("type") == "directory":
            raise IsDirectory("is a directory")
        if info_.get("size") is None:
            raise Permanent("the file system reports no size for it")
        token = "unpinned"
        for name in _VERSION_FIELDS:
            value = info_.get(name)
            if value not in (None, ""):
                shown = value.isoformat() if isinstance(value, datetime) else value
                token = f"{name}:{shown}"
                break
        mtime = next(
            (t for t in (_as_timestamp(info_.get(n)) for n in _MTIME_FIELDS) if t is not None),
            time.time(),
        )
        return ObjectStat(int(info_["size"]), token, mtime)

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes:
        data = self._call(lambda: self._fs.cat_file(self._path, start=start, end=end))
        now = self.stat()
        if (now.size, now.token) != (pin.size, pin.token):
            raise Changed(f"it is now {now.version.describe()}")
        if len(data) != end - start:
            raise Transient(f"short read: {len(data)} of {end - start} bytes")
        return data

