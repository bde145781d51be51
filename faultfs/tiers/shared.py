"""The shared tier: clean blobs of every node in one object store (DESIGN §13).

A blob object is the local blob-file format (header with checksums, then the payload),
keyed ``blobs/<fault key>/<version hash>/<blob name>``: the fault key names the context
(source, tag, chunk geometry), the version hash the source version the bytes are of, so an
object never changes once written and a changed source has other keys.

Invariants:
- ``load`` returns a payload only when the object's header verifies and names this tag,
  this blob and this source version, and every block of the payload matches its checksum;
  anything else is a miss (counted ``shared_damaged``) and the blob is re-published from the
  source over it. No more of an object is read than a blob object of this tag can be (its
  header and one blob): a longer one is refused by its length.
- A failure of the store never fails a read: it is a miss, counted ``shared_errors``, and
  the tier then stays out of the way for a back-off (1 s doubling to 30 s) so reads go to
  the source without waiting on a dead endpoint.
- Publishes run behind the readers (in the mount's nursery) with at most ``budget`` bytes
  waiting; past it a blob is not published (``shared_publish_dropped``). ``drain`` waits
  for them at unmount; the caller bounds it.
- Dirty blobs are never offered to this tier (the engine publishes faulted blobs only).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import quote

import trio

from faultfs.errors import CorruptionError
from faultfs.iopool import run_in_thread
from faultfs.stats import Stats
from faultfs.store.blobfile import HEADER_LEN, decode_header, encode_header
from faultfs.tiers.base import BlobKey, Buffer, TierTag, version_hash
from faultfs.tiers.objects import Objects

if TYPE_CHECKING:
    from faultfs.tiers.claimboard import ClaimBoard

log = logging.getLogger("faultfs.shared")

PUBLISH_BUDGET = 256 << 20  # bytes of blobs waiting to be published
# The shared store's requests have threads of their own, apart from the I/O pool: publishes
# behind the readers must never take the threads a fault needs to read its source.
LOAD_THREADS, PUBLISH_THREADS = 16, 4
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 30.0


def blob_object_key(tag: TierTag, index: int) -> str:
    fault = tag.key.split(":", 1)[-1] or quote(tag.name, safe="")
    return f"blobs/{fault}/{version_hash(tag.version)}/{quote(tag.blob_name(index), safe='')}"


def encode_blob_object(tag: TierTag, index: int, payload: Buffer) -> list[Buffer]:
    header, with_payload = encode_header(tag.name, tag.blob_name(index), payload, flags=0,
                                         source_version=tag.version)
    return [header, payload] if with_payload else [header]


def decode_blob_object(tag: TierTag, index: int, raw: bytes) -> memoryview:
    """The verified payload of a blob object; CorruptionError says what is wrong."""
    header = decode_header(raw[:HEADER_LEN], file_size=len(raw))
    name = tag.blob_name(index)
    if header.tag != tag.name or header.name != name:
        raise CorruptionError(f"object holds {header.tag}/{header.name}, not {tag.name}/{name}")
    if header.source_version != tag.version:
        raise CorruptionError("object is of another source version")
    if header.dirty or header.payload_len != tag.blob_size:
        raise CorruptionError("object is not a clean blob of this tag")
    if header.all_zero:
        return memoryview(bytes(header.payload_len))
    payload = memoryview(raw)[HEADER_LEN:]
    header.check_blocks(0, payload)
    return payload


class SharedTier:
    name = "shared"

    def __init__(self, objects: Objects, stats: Stats, *, budget: int = PUBLISH_BUDGET) -> None:
        self.objects = objects
        self.stats = stats
        self.budget = budget
        self.tags: dict[int, TierTag] = {}
        self.waiting = 0  # bytes of blobs waiting to be published
        # called when a publish ends and its bytes stop counting (the data budget's readers
        # waiting for room look again: ``TierStack``)
        self.freed: Callable[[], None] = lambda: None
        self.pending = 0  # publishes under way
        self._damaged: set[BlobKey] = set()  # objects found bad: the next publish replaces
        self._nursery: trio.Nursery | None = None
        self._down_until = 0.0
        self._backoff = BACKOFF_FIRST_S
        self._idle: trio.Event | None = None
        self._loads: trio.CapacityLimiter | None = None
        self._publishes: trio.CapacityLimiter | None = None
        self.claims: ClaimBoard | None = None  # cross-node single flight (DESIGN §17)
        self.flushing = False  # unmounting: publishes held back go now

    async def _run(self, publishing: bool, fn, *args):
        if self._loads is None or self._publishes is None:
            self._loads = trio.CapacityLimiter(LOAD_THREADS)
            self._publishes = trio.CapacityLimiter(PUBLISH_THREADS)
        limiter = self._publishes if publishing else self._loads
        return await run_in_thread(limiter, fn, *args)

    @property
    def url(self) -> str:
        return self.objects.url

    def open_tag(self, tag: TierTag) -> None:
        self.tags[tag.id] = tag

    def attach(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        if self.claims is not None:
            self.claims.attach(nursery)

    # -- availability ------------------------------------------------------------------------

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: OSError) -> None:
        self.stats.add("shared_errors")
        if self.up:
            log.warning("shared store %s: %s failed (%s); reading from the sources for %.0f s",
                        self.url, what, exc.strerror or exc, self._backoff)
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(BACKOFF_MAX_S, self._backoff * 2)

    def _worked(self) -> None:
        self._backoff = BACKOFF_FIRST_S

    # -- reads -------------------------------------------------------------------------------

    async def load(self, key: BlobKey) -> Buffer | None:
        """The verified payload of blob ``key`` from the shared store, or None (a miss)."""
        tag = self.tags.get(key[0])
        if tag is None:
            return None
        if not self.up:
            self.stats.add("shared_skipped")
            return None
        index = key[1]
        limit = HEADER_LEN + tag.blob_size  # what a blob object of this tag can be
        try:
            raw = await self._run(False, functools.partial(
                self.objects.get, blob_object_key(tag, index), limit=limit))
            if raw is None:
                self._worked()
                self.stats.add("shared_misses")
                return None
            if len(raw) > limit:
                raise CorruptionError(f"object is larger than a blob of this tag ({limit} "
                                      "bytes with its header): not read further")
            payload = decode_blob_object(tag, index, raw)
        except OSError as exc:
            self._failed("a read", exc)
            return None
        except CorruptionError as exc:  # too long, or not a blob object of this blob
            self._worked()
            log.warning("shared store %s: blob %s of tag %s is not usable (%s): re-faulting it",
                        self.url, tag.blob_name(index), tag.name, exc)
            self.stats.add("shared_damaged")
            self._damaged.add(key)
            return None
        self._worked()
        self.stats.add("shared_hits")
        self.stats.add("shared_bytes_in", len(raw))
        return payload

    async def load_run(self, keys: list[BlobKey]) -> list[Buffer | None]:
        """``load`` of each key, at once."""
        out: list[Buffer | None] = [None] * len(keys)

        async def one(i: int) -> None:
            out[i] = await self.load(keys[i])

        if len(keys) == 1:
            await one(0)
            return out
        async with trio.open_nursery() as nursery:
            for i in range(len(keys)):
                nursery.start_soon(one, i)
        return out

    # -- publishes ---------------------------------------------------------------------------

    def publish_soon(self, key: BlobKey, payload: Buffer) -> None:
        """Publish a blob faulted from the source, behind the reader (dropped when the
        budget is spent or the store is down)."""
        if key[0] not in self.tags:
            return
        if not self.up or self.waiting + len(payload) > self.budget:
            self.stats.add("shared_publish_dropped")
            return
        if self._nursery is None:
            return  # not attached (unit tests): publishes are explicit
        self.waiting += len(payload)
        self.pending += 1
        self._nursery.start_soon(self._publish_behind, key, payload)

    def reserve(self, count: int) -> None:
        """Count publishes to come, their bytes not held yet (``drain`` waits for them;
        ``publish_reserved`` sends each, or ``unreserve`` gives it up)."""
        self.pending += count

    def unreserve(self) -> None:
        self._done_with(b"")

    async def publish_reserved(self, key: BlobKey, payload: Buffer) -> bool:
        """``publish_counted`` of a blob ``reserve`` counted."""
        self.waiting += len(payload)
        if key[0] not in self.tags:  # forgotten meanwhile
            self._done_with(payload)
            return False
        return await self._publish_behind(key, payload, claimed=True)

    async def publish_counted(self, key: BlobKey, payload: Buffer) -> bool:
        """``publish`` of a blob fetched under a claim, counted among the publishes under way
        (``drain`` waits for it), its failures logged: other nodes wait for it. Whether the
        blob is in the store now."""
        if key[0] not in self.tags:
            return False
        self.waiting += len(payload)
        self.pending += 1
        return await self._publish_behind(key, payload, claimed=True)

    async def _publish_behind(self, key: BlobKey, payload: Buffer, *,
                              claimed: bool = False) -> bool:
        try:
            return await self.publish(key, payload, claimed=claimed) is not None
        except Exception:  # a background task must never take the mount down
            log.exception("publishing blob %s failed", key)
            self.stats.add("shared_publish_failures")
            return False
        finally:
            self._done_with(payload)

    def _done_with(self, payload: Buffer) -> None:
        self.waiting -= len(payload)
        self.pending -= 1
        if self.pending == 0 and self._idle is not None:
            self._idle.set()
        if len(payload):
            self.freed()

    async def publish(self, key: BlobKey, payload: Buffer, *,
                      claimed: bool = False) -> bool | None:
        """Put blob ``key`` in the shared store unless it is there; True when written, False
        when it was there, None when the store failed. ``claimed``: fetched under a claim of
        its window, whose marker will name it: written over whatever is there (nothing was
        published under a claim; an object there came without one, or is not a blob's)."""
        tag = self.tags[key[0]]
        replace = claimed or key in self._damaged
        parts = encode_blob_object(tag, key[1], payload)

        def put() -> bool:
            data = b"".join(parts)
            return self.objects.put(blob_object_key(tag, key[1]), data, create=not replace)

        try:
            written = await self._run(True, put)
        except OSError as exc:
            self.stats.add("shared_publish_failures")
            self._failed("a publish", exc)
            return None
        self._worked()
        self._damaged.discard(key)
        if written:
            self.stats.add("shared_publishes")
            self.stats.add("shared_bytes_out", sum(len(p) for p in parts))
        else:
            self.stats.add("shared_publish_skipped")  # another node published it first
        return written

    async def drain(self) -> None:
        """Wait for every publish under way, held back ones sent now (the caller bounds the
        wait)."""
        self.flushing = True
        while self.pending:
            self._idle = trio.Event()
            await self._idle.wait()
