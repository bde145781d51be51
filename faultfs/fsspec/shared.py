"""The shared tier for ``faultfs::`` (DESIGN §13): blobs that processes on other nodes faulted,
in one object store (``shared_store="s3://bucket/prefix"``, a local directory, any fsspec
URL), in the mount's blob-object format (``tiers/shared.py``), keyed by the protocol's tag
(object, endpoint, version, chunk size) and the chunk.

Invariants:
- A loaded object is served only when its header names this tag, chunk and version and every
  block verifies (``decode_blob_object``); anything else is a miss and the chunk comes from
  the source (and is published over it).
- A failing store never fails a read: it is a miss, and the tier stays out of the way for a
  back-off (1 s doubling to 30 s) so reads go to the source without waiting on it.
- Publishes run on the caller's pool thread after the chunk is handed to its reader and
  stored locally (off the reader's path); a conditional put skips an object another node
  published first, where the store supports it.
"""

from __future__ import annotations

import logging
import threading
import time

from faultfs.errors import CorruptionError
from faultfs.store.blobfile import HEADER_LEN
from faultfs.tiers.base import TierTag
from faultfs.tiers.objects import Objects
from faultfs.tiers.shared import blob_object_key, decode_blob_object, encode_blob_object

log = logging.getLogger("faultfs.fsspec")

BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0


def chunk_tag(tag: str, version: str, num_chunks: int, length: int) -> TierTag:
    """What the shared tier's format needs to name and check one chunk of ``length`` bytes."""
    return TierTag(id=0, name=tag, version=version, num_blobs=num_chunks, blob_size=length,
                   blob_name=str, blob_index=lambda name: int(name) if name.isdigit() else None,
                   key="fault:" + tag.rsplit("-", 1)[-1])


class SharedBlobs:
    """Loads and publishes of one object store, with a back-off when it fails."""

    def __init__(self, objects: Objects) -> None:
        self.objects = objects
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._backoff = BACKOFF_FIRST_S

    @property
    def url(self) -> str:
        return self.objects.url

    def load(self, tag: TierTag, index: int) -> tuple[bytes | None, str]:
        """The chunk's verified bytes and "hit", or None and why not ("miss", "damaged",
        "error", "down")."""
        if time.monotonic() < self._down_until:
            return None, "down"
        limit = HEADER_LEN + tag.blob_size  # what a blob object of this chunk can be
        try:
            raw = self.objects.get(blob_object_key(tag, index), limit=limit)
        except OSError as exc:
            self._failed("load", exc)
            return None, "error"
        self._worked()
        if raw is None:
            return None, "miss"
        try:
            if len(raw) > limit:
                raise CorruptionError(f"object is larger than a blob of this chunk ({limit} "
                                      "bytes)")
            return bytes(decode_blob_object(tag, index, raw)), "hit"
        except CorruptionError as exc:
            log.warning("shared store %s: blob %s of %s is damaged (%s): faulted again",
                        self.url, index, tag.name, exc)
            return None, "damaged"

    def publish(self, tag: TierTag, index: int, payload: bytes, *, replace: bool) -> bool:
        """Put the chunk's object (``replace``: over a damaged one); whether it was written."""
        if time.monotonic() < self._down_until:
            return False
        data = b"".join(bytes(p) for p in encode_blob_object(tag, index, payload))
        try:
            written = self.objects.put(blob_object_key(tag, index), data, create=not replace)
        except OSError as exc:
            self._failed("publish", exc)
            return False
        self._worked()
        return written

    def _failed(self, what: str, exc: OSError) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self._backoff
            log.warning("shared store %s: %s failed (%s): reading the sources for %.0f s",
                        self.url, what, exc.strerror or exc, self._backoff)
            self._backoff = min(self._backoff * 2, BACKOFF_MAX_S)

    def _worked(self) -> None:
        with self._lock:
            self._backoff = BACKOFF_FIRST_S
