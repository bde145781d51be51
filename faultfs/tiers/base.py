"""The tier protocol: where staged blobs live (memory, the local store, a shared store).

A tier holds whole blobs of registered tags, keyed by ``BlobKey`` = ``(tag id, blob index)``.
It learns a tag's identity (name, source version, blob names) from ``open_tag`` and never
serves a blob of another version. Tiers are tried nearest first (``TierStack``); a tier says
why it did not keep a blob with a ``StoreOutcome``.

Invariants every tier keeps:
- ``get``/``load`` return verified bytes or None (a miss: absent, torn, foreign or stale
  blobs are misses and are dropped); only a damaged *dirty* blob raises (``FaultfsError``,
  EIO): user data cannot be re-faulted, so it is reported, never replaced.
- ``put`` never raises for lack of room: it answers ``FULL`` or a ``SKIPPED_*`` outcome and
  the caller serves the bytes it already has.
- ``contains`` does no I/O.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

Buffer = bytes | memoryview  # replies are slices of held buffers, not copies
BlobKey = tuple[int, int]  # (tag id, blob index)


class StoreOutcome(enum.Enum):
    """What became of a blob offered to a tier. ``counter`` is the stats counter it adds to."""

    STORED = "stored"
    SKIPPED_NO_STORE = "skipped_no_store"  # --no-store: pure read-through
    SKIPPED_BACKOFF = "readthrough_backoff"  # the store was full a moment ago
    SKIPPED_RESERVE = "skipped_reserve"  # it would cross the free-space reserve
    SKIPPED_CACHE_CAP = "skipped_cache_cap"  # nothing evictable makes room under --cache-size
    SKIPPED_DIRTY = "skipped_dirty"  # a user's blob of that name is there: never replaced
    SKIPPED_DEGRADED = "skipped_degraded"  # the store's file system is full or read-only
    FULL = "full"  # the file system said ENOSPC/EDQUOT: back off
    FAILED = "failed"  # any other error (logged)

    @property
    def counter(self) -> str:
        return "store_failures" if self in (StoreOutcome.FULL, StoreOutcome.FAILED) else self.value


@dataclass(frozen=True)
class TierTag:
    """What a tier knows of a tag: enough to name, find and check its blobs."""

    id: int
    name: str
    version: str  # SourceVersion.to_text(): clean blobs of another version are stale
    num_blobs: int
    blob_size: int  # payload bytes of every blob
    blob_name: Callable[[int], str]
    blob_index: Callable[[str], int | None]
    key: str = ""  # the context's fault key: the shared tier's objects are named by it


def version_hash(version: str) -> str:
    """What names a source version in the shared store's keys (blob and claim objects)."""
    return hashlib.sha256(version.encode("utf-8", "surrogateescape")).hexdigest()[:16]


@dataclass(frozen=True)
class Capacity:
    used: int  # bytes of clean (evictable) blobs held
    limit: int  # 0: no limit but the free-space reserve


class Tier(Protocol):
    name: str

    def open_tag(self, tag: TierTag) -> None:
        """Start holding blobs of ``tag`` (blocking: a store tier scans what it already has)."""
        ...

    def contains(self, key: BlobKey) -> bool: ...

    async def get(self, key: BlobKey, off: int, size: int) -> Buffer | None:
        """Bytes ``[off, off+size)`` of the blob (clipped), or None on a miss."""
        ...

    async def load(self, key: BlobKey) -> Buffer | None:
        """The whole verified payload, or None on a miss."""
        ...

    async def put(self, key: BlobKey, data: Buffer) -> StoreOutcome: ...

    async def evict(self, key: BlobKey) -> int:
        """Drop a clean blob; the bytes freed."""
        ...

    def capacity(self) -> Capacity: ...


class OpenBlobWatcher(Protocol):
    """Told which staged blob files the local tier holds open (``LocalTier.watch``): a reader
    of its own may use a blob's file (a copy of its descriptor) from ``opened`` until
    ``closed``, and never after — the tier says ``closed`` before it evicts, replaces or drops
    the blob, so nothing stored later under that name is read through the old file."""

    def opened(self, key: BlobKey, blob: Any) -> None:
        """``blob`` (a ``store.blobstore.OpenBlob`` whose header the tier verified) is open."""
        ...

    def closed(self, key: BlobKey) -> None: ...

    def forgot(self, tag_id: int) -> None:
        """The tag is unregistered."""
        ...
