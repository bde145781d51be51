"""The local tier's open-file cache: recently read blob files kept open (a random reader of
staged blobs then skips the open and the header read), the least recently read let go first,
and the reads in flight of each.

Invariants:
- At most ``cap`` files are kept (a quarter of the descriptor limit, at most
  ``OPEN_BLOB_CACHE``); one file per blob.
- A blob file is never closed while a read of it is in flight: one let go meanwhile is
  closed by its last reader (``release``).
- The watcher (the fast read path) hears of every file kept (``opened``) and of every one let
  go (``closed``) before it is closed, and of a forgotten tag (``forgot``).
"""

from __future__ import annotations

import collections
import resource

from faultfs.store.blobstore import OpenBlob
from faultfs.tiers.base import BlobKey, OpenBlobWatcher

# Store files kept open for hits (about 1.3 KB each): a random reader of staged blobs then
# skips the open and the header read. At most a quarter of the descriptor limit.
OPEN_BLOB_CACHE = 8192


class OpenBlobs:
    """Blob files kept open for reads, by blob, in the order they were last read."""

    def __init__(self) -> None:
        self._open: collections.OrderedDict[BlobKey, OpenBlob] = collections.OrderedDict()
        self._in_use: dict[BlobKey, int] = {}
        self.cap = open_cap()
        self._watcher: OpenBlobWatcher | None = None

    def __contains__(self, key: BlobKey) -> bool:
        return key in self._open

    def __len__(self) -> int:
        return len(self._open)

    def watch(self, watcher: OpenBlobWatcher | None) -> None:
        """Tell ``watcher`` of every blob file kept open, from now on (those open already
        first) until it lets each go; None stops telling."""
        self._watcher = watcher
        if watcher is not None:
            for key, blob in self._open.items():
                watcher.opened(key, blob)

    def lookup(self, key: BlobKey) -> OpenBlob | None:
        """The blob's open file (now the most recently read), or None."""
        blob = self._open.get(key)
        if blob is not None:
            self._open.move_to_end(key)
        return blob

    def add(self, key: BlobKey, blob: OpenBlob) -> OpenBlob:
        """Keep ``blob`` open; the file to read: the one kept already when another reader
        opened it meanwhile (``blob`` is then closed). The least recently read go past
        ``cap``."""
        if key in self._open:  # another reader opened it meanwhile
            blob.close()
            return self._open[key]
        self._open[key] = blob
        if self._watcher is not None:
            self._watcher.opened(key, blob)
        while len(self._open) > self.cap:
            old, gone = self._open.popitem(last=False)
            self._let_go(old, gone)
        return blob

    def hold(self, key: BlobKey) -> None:
        """A read of the blob's file begins: it stays open until ``release``."""
        self._in_use[key] = self._in_use.get(key, 0) + 1

    def release(self, key: BlobKey, blob: OpenBlob) -> None:
        """A read of ``blob`` ended: its file is closed when it was the last read of a file
        let go meanwhile (or never kept)."""
        left = self._in_use[key] - 1
        if left:
            self._in_use[key] = left
        else:
            del self._in_use[key]
            if key not in self._open:
                blob.close()

    def in_use(self, key: BlobKey) -> bool:
        """Whether a read of the blob's file is in flight."""
        return key in self._in_use

    def drop(self, key: BlobKey) -> None:
        """Let the blob's file go (evicted, replaced or damaged)."""
        blob = self._open.pop(key, None)
        if blob is not None:
            self._let_go(key, blob)

    def forget_tag(self, tag_id: int) -> None:
        """Let every file of a forgotten tag go."""
        for key in [k for k in self._open if k[0] == tag_id]:
            self.drop(key)
        if self._watcher is not None:
            self._watcher.forgot(tag_id)

    def _let_go(self, key: BlobKey, blob: OpenBlob) -> None:
        """``blob`` left the cache: its watcher first, then the file (unless a read holds it)."""
        if self._watcher is not None:
            self._watcher.closed(key)
        if not self._in_use.get(key):
            blob.close()

    def raise_cap(self) -> None:
        """Re-read the descriptor limit (the mount raises it before serving)."""
        self.cap = open_cap()

    def close(self) -> None:
        """Close every file kept (the tier is closing)."""
        for key, blob in self._open.items():
            if self._watcher is not None:
                self._watcher.closed(key)
            blob.close()
        self._open.clear()


def open_cap() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return OPEN_BLOB_CACHE
    return max(16, min(OPEN_BLOB_CACHE, soft // 4))
