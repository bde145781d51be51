"""Which blobs of each tag the local store holds: one bit per blob (``StagedSet``), so a tag
with millions of chunks costs bytes, not objects, and the scan that fills it when a tag is
opened (``scan``).

Invariants:
- A ``StagedSet``'s ``count`` is the number of its bits set.
- The scan marks a blob staged only when its file is in the tag's directory; a trusted scan
  reads no header (a read checks it again), an untrusted one drops blobs whose header is
  damaged or whose clean payload was staged from another source version.
- Clean blobs found are noted with the store policy (their bytes count towards its cap);
  dirty ones are never candidates for eviction.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

from faultfs.store.blobstore import BlobStore
from faultfs.tiers.base import TierTag
from faultfs.tiers.policy import StorePolicy

_SET_BYTE = re.compile(rb"[^\x00]")


class StagedSet:
    """One bit per blob of a tag: which are staged in the local store."""

    __slots__ = ("bits", "count")

    def __init__(self, num_blobs: int) -> None:
        self.bits = bytearray((num_blobs + 7) // 8)
        self.count = 0

    def __contains__(self, index: int) -> bool:
        return bool(self.bits[index >> 3] & (1 << (index & 7)))

    def indices(self, first_byte: int = 0, end_byte: int | None = None) -> Iterator[int]:
        """The staged blobs' indices, in order (of bitmap bytes ``[first_byte, end_byte)``)."""
        view = memoryview(self.bits)[first_byte:end_byte]
        for found in _SET_BYTE.finditer(view):  # skips runs of zero bytes at C speed
            byte = first_byte + found.start()
            bits = self.bits[byte]
            for bit in range(8):
                if bits & (1 << bit):
                    yield byte * 8 + bit

    def mark(self, index: int, staged: bool) -> None:
        byte, bit = index >> 3, 1 << (index & 7)
        was = bool(self.bits[byte] & bit)
        if staged and not was:
            self.bits[byte] |= bit
            self.count += 1
        elif was and not staged:
            self.bits[byte] &= ~bit
            self.count -= 1


@dataclass
class ScanResult:
    """What ``open_tag`` found in the store for a tag."""

    staged: int = 0
    stale_dropped: int = 0
    corrupt_dropped: int = 0


def scan(store: BlobStore, policy: StorePolicy, tag: TierTag, staged: StagedSet, *,
         trusted: bool) -> ScanResult:
    """Mark in ``staged`` the blobs ``store`` holds for ``tag`` (blocking; payloads are
    verified on read); ``trusted``: as ``LocalTier.open_tag`` says."""
    result = ScanResult()
    if trusted:
        for name, size in store.scan_blobs(tag.name):
            index = tag.blob_index(name)
            if index is not None:
                staged.mark(index, True)
                policy.note_stored((tag.id, index), size)
        result.staged = staged.count
        return result
    for name in store.list_blobs(tag.name):
        index = tag.blob_index(name)
        if index is None:
            continue
        header = store.read_header(store.blob_path(tag.name, name))
        if header is None:
            store.delete(tag.name, name)
            result.corrupt_dropped += 1
            continue
        if not header.dirty and header.source_version != tag.version:
            store.delete(tag.name, name)
            result.stale_dropped += 1
            continue
        staged.mark(index, True)
        if not header.dirty:
            policy.note_stored((tag.id, index), store.file_bytes(tag.name, name))
    result.staged = staged.count
    return result
