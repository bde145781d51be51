"""One object opened through the protocol: its source pinned at the version it has now, its
tag (named by the object *and* that version: a new version is a new tag, never a mix), and
its chunks read from the shared store — a hit, a wait for another process's fault, or a
fault of our own (DESIGN §5, §18).

Invariants:
- Bytes served are the pinned version's: from a blob whose header verified against this tag,
  name and version and whose blocks verify as they are read, or just read from the pinned
  source (which refuses to read another version). A failed fault raises; zeros are never
  served.
- One source read per blob per store: in this process by single-flight, across processes by
  the blob's claim (``claims.py``); a blob is published whole (``BlobStore.publish``).
- A blob that may not be stored (reserve, cap, back-off, a full file system) is served from
  the bytes read; nothing partial is left.
- A reader of a chunk in flight here waits for its own bytes only (``landing.py``); a fault
  that failed is dropped from the flights, so the next read asks the source again.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import functools
import logging
import os
import resource
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as _json_str
from typing import TYPE_CHECKING

from faultfs.core.context import fnv1a64
from faultfs.core.names import PROTOCOL_TAG_PREFIX
from faultfs.errors import CorruptionError, FaultfsError, SourceChanged, StoreFull
from faultfs.fsspec.claims import Claim, Claims
from faultfs.fsspec.landing import Landing, SplitLane, read_chunk, split_at
from faultfs.fsspec.mounted import MountBlob, MountTags
from faultfs.fsspec.pins import PinRecords
from faultfs.fsspec.planning import PlannedFlights, Planner
from faultfs.fsspec.space import SharedSpace
from faultfs.sources import Source
from faultfs.store.blobfile import HEADER_LEN
from faultfs.store.blobstore import BlobStore, OpenBlob

if TYPE_CHECKING:  # the shared tier's code (and trio under it) loads only when one is used
    from faultfs.fsspec.shared import SharedBlobs

log = logging.getLogger("faultfs.fsspec")

CLAIM_WAIT_S = 120.0  # the longest wait for another process's fault before reading through
# blob files kept open per object for hits, the least recently read closed first: 64 MiB of
# 4 MiB chunks for a random reader (8 reopened a blob every other read of a 64 MiB object)
OPEN_BLOBS = 16
KEPT_FLIGHTS = 16  # finished faults whose bytes wait for their reader, per object
PROCESS_OPEN_BLOBS = 256  # and in a whole process, at most (else a quarter of RLIMIT_NOFILE)


class _OpenShare:
    """The blob files this process's objects keep open, shared out: ``total`` (a quarter of
    the descriptor limit, at most ``PROCESS_OPEN_BLOBS``) evenly among the objects open, at
    least one each and at most ``OPEN_BLOBS`` — xarray's ``open_mfdataset`` holding hundreds
    of objects open must not run out of descriptors. An object trims to its share when it
    opens its next blob file, so the bound is ``total`` plus about one per object open."""

    def __init__(self) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = PROCESS_OPEN_BLOBS if soft == resource.RLIM_INFINITY else soft // 4
        self.total = max(1, min(PROCESS_OPEN_BLOBS, limit))
        self.objects = 0
        self._lock = threading.Lock()

    def join(self) -> None:
        with self._lock:
            self.objects += 1

    def leave(self) -> None:
        with self._lock:
            self.objects -= 1

    def share(self) -> int:
        return max(1, min(OPEN_BLOBS, self.total // max(1, self.objects)))


OPEN_SHARE = _OpenShare()


@functools.lru_cache(maxsize=4096)  # fnv1a64 is pure Python: paid once per object version
def tag_for(url: str, endpoint: str, version: str, chunk_size: int) -> str:
    """The tag of ``url`` (reached at ``endpoint``) at ``version``, cut in ``chunk_size``."""
    # json.dumps([url, endpoint, version, chunk_size], separators=(",", ":")), byte for byte
    # (tags are persistent names), without its encoder's setup in every new process
    identity = (f"[{_json_str(url)},{_json_str(endpoint)},{_json_str(version)},"
                f"{int(chunk_size)}]")
    return f"{PROTOCOL_TAG_PREFIX}{fnv1a64(identity.encode()):016x}"


class Counters:
    """What one file system did, by name (faults, hits, source bytes, stored, skipped ...);
    thread-safe."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass
class Shared:
    """What every object of one file system uses: the store, its claims and space, the pool
    that runs faults and read-aheads, the counters."""

    store: BlobStore
    claims: Claims
    space: SharedSpace
    pool: concurrent.futures.ThreadPoolExecutor
    stats: Counters
    pins: PinRecords
    mounts: MountTags
    store_enabled: bool = True
    tier: SharedBlobs | None = None  # shared_store: blobs other nodes faulted (shared.py)
    running: set[concurrent.futures.Future[None]] = field(default_factory=set)
    lane: SplitLane = field(default_factory=SplitLane)  # split faults' second parts
    # faults HDF5 planning started, of every object, not landed yet (``planning.py``)
    planned: PlannedFlights = field(default_factory=lambda: PlannedFlights(16))

    def submit(self, fn: Callable[..., None], *args: object) -> None:
        """Run ``fn`` on the pool; ``drain`` waits for it."""
        task = self.pool.submit(fn, *args)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for faults, stores and publishes under way; True when all ended."""
        _, left = concurrent.futures.wait(list(self.running), timeout=timeout)
        return not left


@dataclass
class _Held:
    """A blob file kept open for hits, and how many reads of it are under way."""

    blob: OpenBlob
    tag: str  # where the blob file stands: this object's tag, or a mount's (mounted.py)
    name: str
    users: int = 0
    closing: bool = False  # dropped from the open set: closed when its last read ends
    closed: bool = False


class PinnedObject:
    """A source object at one version, read through the shared store in chunks."""

    def __init__(self, source: Source | Callable[[], Source], tag: str, version: str,
                 size: int, chunk_size: int, shared: Shared, *,
                 forget: Callable[[], None] | None = None,
                 mounted: MountBlob | None = None) -> None:
        # the source, or how to open it when a chunk must be faulted (a pin taken from a
        # recent record: ``pins.py``)
        self._source: Source | None = None if callable(source) else source
        self._opener = source if callable(source) else None
        self._forget = forget  # drops the recorded pin this object came from, found stale
        self._mounted = mounted  # a mount's tag of this object at this version: its hits too
        self.tag = tag
        self.version = version
        self.size = size
        self.chunk_size = chunk_size
        self.shared = shared
        self._flights: dict[int, Landing] = {}
        self._lock = threading.Lock()
        self._source_lock = threading.Lock()  # held while a recorded pin's source opens
        self._open: dict[int, _Held] = {}
        self._paths: dict[int, str] = {}  # blob files by chunk: their names encoded once
        self._seen: set[int] = set()  # chunks found staged by the read-ahead (``_on_disk``)
        self._closed = False
        # an HDF5 reader's next reads, planned from the bytes it is served (``planning.py``)
        self._planner = Planner.of(size, chunk_size, shared, self._wanted, self._start_fault)
        OPEN_SHARE.join()

    @property
    def num_chunks(self) -> int:
        return -(-self.size // self.chunk_size)

    def read(self, start: int, end: int, *, ahead: int = 0) -> bytes:
        """Bytes ``[start, end)`` (clipped to the object); the ``ahead`` chunks after the
        last one read are faulted in the background (a sequential reader's read-ahead)."""
        end = min(end, self.size)
        if start >= end:
            return b""
        cs = self.chunk_size
        first, last = start // cs, (end - 1) // cs
        if ahead:
            self._read_ahead(last, ahead)
        if first == last:
            out = self._range(first, start - first * cs, end - start)
        else:
            # several chunks: their faults run at once (each on the pool), then the pieces join
            for index in range(first + 1, last + 1):
                if index not in self._open and self._hit(index, 0, 0) is None:
                    self._start_fault(index)
            parts = []
            for index in range(first, last + 1):
                lo = max(start, index * cs) - index * cs
                hi = min(end, (index + 1) * cs) - index * cs
                parts.append(self._range(index, lo, hi - lo))
            out = b"".join(parts)
        self._planned(start, out)
        return out

    def read_into(self, start: int, out: memoryview, *, ahead: int = 0) -> int:
        """As ``read``, into ``out`` (bytes from ``start``, as many as fit); how many. A hit
        within one chunk is read straight into ``out`` (``OpenBlob.preadinto``)."""
        end = min(start + len(out), self.size)
        if start >= end:
            return 0
        cs = self.chunk_size
        index = start // cs
        if (end - 1) // cs == index and index not in self._flights:
            if ahead:
                self._read_ahead(index, ahead)
                ahead = 0
            got = self._hit(index, start - index * cs, end - start, into=out)
            if got is not None:
                self.shared.stats.add("hits")
                self._planned(start, out[:int(got)])
                return int(got)  # type: ignore[arg-type]
        data = self.read(start, end, ahead=ahead)
        out[:len(data)] = data
        return len(data)

    def _planned(self, start: int, data: bytes | memoryview) -> None:
        if self._planner is not None:
            self._planner.served(start, data)

    def _wanted(self, index: int) -> bool:
        """Whether chunk ``index`` is one to fault ahead: the object open, the chunk neither
        open, in flight nor staged."""
        return not (self._closed or index in self._open or index in self._flights
                    or self._on_disk(index))

    def _read_ahead(self, last: int, ahead: int) -> None:
        """Fault the ``ahead`` chunks after chunk ``last`` that are not here yet."""
        for index in range(last + 1, min(last + 1 + ahead, self.num_chunks)):
            if self._wanted(index):
                self._start_fault(index)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                OPEN_SHARE.leave()
            held, self._open = list(self._open.values()), {}
            for one in held:
                one.closing = True
        for one in held:
            self._let_go(one, release=False)
        if self._source is not None:
            self._source.close()

    @property
    def source(self) -> Source:
        """The source, opened now if the pin came from a record; SourceChanged when the
        object is no longer the version pinned."""
        with self._source_lock:
            if self._source is None:
                if self._closed:  # a fault queued before the close (read-ahead, planning):
                    raise FaultfsError("the object was closed")  # nothing opens it again
                assert self._opener is not None
                try:
                    source = self._opener()
                except FaultfsError as exc:
                    if exc.errno == errno.ENOENT and self._forget is not None:
                        self._forget()  # gone: the next open asks and says so
                    raise
                if source.pinned.to_text() != self.version:  # type: ignore[attr-defined]
                    source.close()
                    if self._forget is not None:
                        self._forget()  # the next open pins the new version: a new tag
                    raise SourceChanged(f"source {source.url} changed since it was pinned "
                                        f"({self.version}); open it again")
                self._source = source
            return self._source

    # -- one chunk -------------------------------------------------------------------------

    def _range(self, index: int, off: int, size: int) -> bytes:
        """Bytes ``[off, off + size)`` of chunk ``index``: a hit (one pread of a held blob
        file), or from its fault in flight here as soon as they have landed, or from a fault
        started now (split at ``off``, far enough in: ``landing.split_at``)."""
        with self._lock:
            flight = self._flights.get(index)
        stats = self.shared.stats
        if flight is None:
            data = self._hit(index, off, size)
            if data is not None:
                stats.add("hits")
                return data
            flight = self._start_fault(index, at=off)
        else:
            stats.add("memory_hits" if flight.done() else "joined")
        got, early = flight.range(off, off + size)
        if early:
            stats.add("head_reads")
        return bytes(got)

    def _hit(self, index: int, off: int, size: int, *, into: memoryview | None = None
             ) -> bytes | int | None:
        """Bytes of a staged, verified blob (read into ``into`` when given: how many), or
        None (absent, stale, damaged: dropped)."""
        with self._lock:
            held = self._open.pop(index, None)
            if held is not None:
                self._open[index] = held  # the most recently read last: spilled last
                held.users += 1
        if held is None:
            held = self._hold(index)
            if held is None:
                return None
        try:
            if size == 0:
                return b""
            try:
                if into is not None:
                    return held.blob.preadinto(into[:size], off)
                return held.blob.pread(size, off)
            except CorruptionError:
                with self._lock:
                    if self._open.get(index) is held:
                        del self._open[index]
                        held.closing = True
                self.shared.store.discard_damaged(held.tag, held.name, ino=held.blob.ino)
                self.shared.stats.add("damaged_dropped")
                return None
        finally:
            self._let_go(held)

    def _hold(self, index: int) -> _Held | None:
        """The blob file of chunk ``index``, kept open (at most this object's share of
        ``OPEN_SHARE``) and held for a read: a file is closed only once no read of it is
        under way (``_let_go``)."""
        with self._lock:
            held = self._open.get(index)
            if held is not None:
                held.users += 1
                return held
        tag, name, path = self.tag, str(index), self._path(index)
        blob = self.shared.store.open_blob(tag, name, source_version=self.version, path=path)
        if blob is not None:  # the protocol's LRU: a mount's blobs are the mount's to keep
            self.shared.space.touch(path, blob.mtime)
        elif self._mounted is not None:
            blob = self._mounted.open(index)
            tag, name = self._mounted.tag, self._mounted.name(index)
            if blob is not None:
                self.shared.stats.add("mount_hits")
        if blob is None:
            return None
        spilled = []
        with self._lock:
            held = self._open.get(index)
            if held is None:  # else another thread opened it meanwhile: use that one
                held = self._open[index] = _Held(blob, tag, name)
                blob = None
                while len(self._open) > OPEN_SHARE.share():
                    spilled.append(self._open.pop(next(iter(self._open))))
                    spilled[-1].closing = True
            held.users += 1
        if blob is not None:
            blob.close()
        for other in spilled:
            self._let_go(other, release=False)
        return held

    def _let_go(self, held: _Held, *, release: bool = True) -> None:
        with self._lock:
            if release:
                held.users -= 1
            close = held.closing and held.users == 0 and not held.closed
            held.closed = held.closed or close
        if close:
            held.blob.close()

    def _start_fault(self, index: int, *, at: int = 0) -> Landing:
        """A fault of chunk ``index`` on the pool (or the one in flight); ``at``: where its
        reader's bytes start. Its bytes wait in ``_flights`` for the reader that takes them
        (``_range``), so a chunk that could not be stored is not read twice; the oldest
        finished ones go past ``KEPT_FLIGHTS``."""
        with self._lock:
            flight = self._flights.get(index)
            if flight is not None:
                return flight
            done = [i for i, f in self._flights.items() if f.done()]
            for old in done[:max(0, len(self._flights) - KEPT_FLIGHTS)]:
                del self._flights[old]
            flight = self._flights[index] = Landing()
        try:
            self.shared.submit(self._fault_into, index, flight, at)
        except BaseException as exc:  # no pool (the interpreter is exiting): no one waits
            self._drop_failed(index, flight, exc)
            raise
        return flight

    def _drop_failed(self, index: int, flight: Landing, exc: BaseException) -> None:
        """A fault that failed: its readers get ``exc`` (nothing if it had its bytes), and
        the next read asks the source again."""
        flight.fail(exc)
        with self._lock:
            if self._flights.get(index) is flight:
                del self._flights[index]

    def _fault_into(self, index: int, landed: Landing, at: int) -> None:
        """Run on the pool: fault chunk ``index``, its bytes shown to ``landed`` as they
        land and handed to it whole once read (its store write follows, off the reader's
        path). The flight stays in ``_flights`` until its blob is published, so a read
        meanwhile takes the bytes from memory; a chunk that was not stored stays there for
        its reader."""
        try:
            stored = self._fault_here(index, landed, at)
        except BaseException as exc:
            self._drop_failed(index, landed, exc)
            if not isinstance(exc, Exception):
                raise
            return
        if stored:
            with self._lock:
                if self._flights.get(index) is landed:
                    del self._flights[index]

    def _on_disk(self, index: int) -> bool:
        """Whether a blob file of chunk ``index`` stands in the store (ours or the mount's);
        a chunk once seen there is not looked for again (read-ahead asks on every read: an
        evicted one is faulted when its reader gets there)."""
        if index in self._seen:
            return True
        found = os.path.exists(self._path(index)) or (
            self._mounted is not None and os.path.exists(self._mounted.path(index)))
        if found:
            self._seen.add(index)
        return found

    def _path(self, index: int) -> str:
        """The file of chunk ``index``'s blob in this object's tag."""
        path = self._paths.get(index)
        if path is None:
            path = self._paths[index] = self.shared.store.blob_path(self.tag, str(index))
        return path

    def _chunk_len(self, index: int) -> int:
        return min(self.chunk_size, self.size - index * self.chunk_size)

    def _fault_here(self, index: int, landed: Landing, at: int) -> bool:
        """Fault chunk ``index`` under its claim into ``landed``: another process's fault is
        waited for and read from the store; else the source is read, the bytes shown as
        they land and handed over, and the blob published. Whether the blob is in the store
        now."""
        shared, name, length = self.shared, str(index), self._chunk_len(index)
        if not shared.store_enabled or not shared.store.writable:
            landed.finish(self._from_shared(index, length, landed, at)[0])
            return False
        claim = shared.claims.acquire(
            self.tag, name, deadline_s=CLAIM_WAIT_S,
            done=lambda: os.path.exists(self._path(index)))
        if claim is None:  # published by another process meanwhile (or it took too long)
            hit = self._hit(index, 0, length)
            if hit is not None:
                shared.stats.add("claim_waits")
            landed.finish(hit if hit is not None else self._from_source(index, length, landed,
                                                                        at))
            return hit is not None
        try:
            hit = self._hit(index, 0, length)  # published just before we held the claim
            if hit is not None:
                shared.stats.add("claim_waits")
                landed.finish(hit)
                return True
            data, origin = self._from_shared(index, length, landed, at)
            landed.finish(data)
            stored = self._store(name, data, claim)
            if origin:  # read from the source: other nodes may want it
                self._publish(index, data, replace=origin == "damaged")
            return stored
        finally:
            claim.release()

    def _from_shared(self, index: int, length: int, landed: Landing, at: int
                     ) -> tuple[bytes | memoryview, str]:
        """The chunk from the shared tier, or from the source (shown to ``landed`` as it
        lands); with "" when it came from the tier, else what the tier said ("miss",
        "damaged", ...; "none": no tier)."""
        tier = self.shared.tier
        if tier is None:
            return self._from_source(index, length, landed, at), "none"
        data, said = tier.load(self._chunk_tag(index, length), index)
        self.shared.stats.add(f"shared_{said}")
        if data is not None:
            self.shared.stats.add("shared_bytes", len(data))
            return data, ""
        return self._from_source(index, length, landed, at), said

    def _publish(self, index: int, data: bytes | memoryview, *, replace: bool) -> None:
        tier = self.shared.tier
        if tier is not None and tier.publish(self._chunk_tag(index, len(data)), index, data,
                                             replace=replace):
            self.shared.stats.add("shared_publishes")

    def _chunk_tag(self, index: int, length: int):
        from faultfs.fsspec.shared import chunk_tag

        return chunk_tag(self.tag, self.version, self.num_chunks, length)

    def _from_source(self, index: int, length: int, landed: Landing, at: int
                     ) -> bytes | memoryview:
        """Chunk ``index`` read from the source, shown to ``landed`` as it lands; split at
        ``at`` when its reader starts far enough in (``landing.split_at``)."""
        shared, stats = self.shared, self.shared.stats
        stats.add("faults")
        data, split = read_chunk(self.source, index * self.chunk_size, length, landed.show,
                                 at=split_at(at, length), lane=shared.lane)
        if len(data) != length:
            raise FaultfsError(f"source {self.source.url} returned {len(data)} bytes of chunk "
                               f"{index} instead of {length}: it changed or was cut short")
        stats.add("source_reads")
        stats.add("source_bytes", length)
        if split:
            stats.add("split_faults")
        return data

    def _store(self, name: str, data: bytes | memoryview, claim: Claim) -> bool:
        shared = self.shared
        need = len(data) + HEADER_LEN  # what the blob file takes
        skipped = shared.space.admit(need)
        if skipped is not None:
            shared.stats.add(f"skipped_{skipped}")
            return False
        try:
            tmp = shared.store.temp_path(self.tag)
            claim.record(tmp)  # a kill -9 from here on leaves tmp to the next claimer
            shared.store.publish(self.tag, name, data, tmp, source_version=self.version)
        except StoreFull:
            shared.space.give_back(need)
            shared.space.full()
            shared.stats.add("store_failures")
            return False
        except (OSError, FaultfsError) as exc:
            shared.space.give_back(need)
            shared.stats.add("store_failures")
            log.warning("store %s: blob %s of %s not stored: %s", shared.store.root, name,
                        self.tag, exc)
            return False
        shared.stats.add("stored")
        shared.stats.add("stored_bytes", len(data))
        return True
