"""The store policy (DESIGN §5.3): whether a fault-ingested blob is kept in the local store, and
which clean blobs make room for it.

A fault-ingested blob can always be re-ingested, so it may never take the last of a tier:
- ``--no-store`` (``FAULTFS_STORE=0``): never store, pure read-through;
- after a store failed because the file system was full, the next ``backoff_faults`` faults
  are served without storing, then storing is tried again;
- the free-space reserve (``--reserve-mb``) must stay free after the write;
- a size cap (``--cache-size``) evicts least-recently-used clean blobs, never one being read
  and never a dirty one (dirty blobs are not in the LRU at all).

The policy runs on the trio thread and does no I/O: it decides, the local tier acts.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from faultfs.tiers.base import BlobKey, StoreOutcome


class StorePolicy:
    def __init__(self, *, store_enabled: bool, reserve_bytes: int, cache_size: int,
                 backoff_faults: int) -> None:
        self.store_enabled = store_enabled
        self.reserve_bytes = reserve_bytes
        self.cache_size = cache_size
        self.backoff_faults = backoff_faults
        self.backoff_left = 0
        self._lru: collections.OrderedDict[BlobKey, int] = collections.OrderedDict()
        self.lru_bytes = 0  # bytes of the clean blobs in the LRU
        self.reserved = 0  # bytes of blobs admitted under the cap, being written now

    def admit(self) -> StoreOutcome | None:
        """A ``SKIPPED_*`` outcome when no blob may be stored now, else None."""
        if not self.store_enabled:
            return StoreOutcome.SKIPPED_NO_STORE
        if self.backoff_left > 0:
            self.backoff_left -= 1
            return StoreOutcome.SKIPPED_BACKOFF
        return None

    def victims(self, need: int, busy: Callable[[BlobKey], bool]) -> list[BlobKey] | None:
        """Least-recently-used clean blobs to evict so ``need`` more bytes fit the cap, taken
        out of the LRU, and ``need`` reserved until ``release`` (writes in flight count
        against the cap, so concurrent faults cannot overshoot it together); None (nothing
        changed) when nothing evictable makes room."""
        cap = self.cache_size
        if not cap:
            return []
        if need > cap:
            return None
        over = self.lru_bytes + self.reserved + need - cap
        picked: list[BlobKey] = []
        for key, size in self._lru.items():
            if over <= 0:
                break
            if busy(key):
                continue  # being read right now: pick another
            picked.append(key)
            over -= size
        if over > 0:
            return None
        for key in picked:
            self.forget(key)
        self.reserved += need
        return picked

    def release(self, need: int) -> None:
        """The write ``victims`` reserved for is done (stored or not)."""
        if self.cache_size:
            self.reserved -= need

    def fits_reserve(self, free_bytes: int, need: int) -> bool:
        return free_bytes - need >= self.reserve_bytes

    def store_full(self) -> None:
        """The file system refused a write for lack of room: read through for a while."""
        self.backoff_left = self.backoff_faults

    def note_stored(self, key: BlobKey, size: int) -> None:
        self.forget(key)
        self._lru[key] = size
        self.lru_bytes += size

    def touch(self, key: BlobKey) -> None:
        if key in self._lru:
            self._lru.move_to_end(key)

    def forget(self, key: BlobKey) -> int:
        size = self._lru.pop(key, 0)
        self.lru_bytes -= size
        return size
