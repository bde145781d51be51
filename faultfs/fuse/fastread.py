"""Staged reads answered in C, on threads of their own, before pyfuse3 and trio (``_fastread.c``).

Why: a read of a staged blob cost the serving thread 150–250 µs of CPU through pyfuse3, trio
and the engine, against ~30 µs for an empty FUSE round trip (docs/benchmarks.md, "Staged
reads"), and one Python thread served every request: that per-request cost, and one disk read
at a time, bounded random reads of staged data. With the fast read path a few threads of the
compiled piece read the FUSE device themselves. A chunk or view read inside one staged blob of
a tag without writes is answered there, without entering Python: the blocks it covers are read
from the blob file and verified against the blob header's checksums, and the disk reads of
concurrent readers overlap. Every other request goes to pyfuse3 unchanged, through a queue it
waits on as it would on the device (``prepare`` before ``pyfuse3.init``; the queue's
descriptor is what ``fastwait`` polls).

What it serves is exactly what the engine would serve from the local tier:
- a blob is published while the local tier holds its file open (``LocalTier._open``), with
  the header the tier verified; the tier withdraws it whenever it lets that file go (evicted,
  replaced, damaged, its tag forgotten), before anything else can be stored under its name;
- a tag is served only while it has no writes: it is enabled when one of its chunks or its view
  is opened and its view does not take the writes' path (``Engine.has_writes_path``), and
  disabled (``Engine.watch_writes``) the moment a write, truncate or clone gives it write
  state, before that write is answered;
- a clone's clean chunks are its ancestor's staged blobs (``Tag.clean``): its reads are served
  from the blobs published under the ancestor's id;
- every other read — another kind of file, a read across blobs, a blob not staged or not open,
  a block that fails its checksum, a failed read — is pyfuse3's, which reads it through the
  engine (which finds what is wrong with a blob and re-faults it).

The read's bookkeeping happens later, in bulk: ``harvest`` (before each stats snapshot, and
every second) adds the served reads to the counters and touches the blobs read in the store's
LRU. The prefetch window does not see reads served here (they are staged already). When a tag
is enabled, the local tier opens its staged blobs ahead, in the background and into the
open-file cache's free room only, so that their first reads are served here too.

``FAULTFS_FAST_READ=0`` switches it off; so does a missing compiled piece.
"""

from __future__ import annotations

import array
import ctypes
import functools
import logging
from typing import TYPE_CHECKING

import trio
import xxhash

from faultfs.core.inodes import INDEX_BITS, KIND_BITS, KIND_CHUNK, KIND_VIEW
from faultfs.fuse.lowlevel import native
from faultfs.store.blobfile import HEADER_LEN
from faultfs.tiers.base import BlobKey

if TYPE_CHECKING:
    from faultfs.config import Config
    from faultfs.engine import Engine
    from faultfs.store.blobstore import OpenBlob

log = logging.getLogger("faultfs.mount")

HARVEST_S = 1.0  # the served reads reach the counters and the LRU this often at least


@functools.cache
def xxh3_address() -> int | None:
    """The address of python-xxhash's own ``XXH3_64bits`` (the vectorised one it was built
    with: the blocks then verify at the same speed as on the Python path), or None."""
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
        fn = lib.XXH3_64bits
    except (AttributeError, OSError):
        return None
    fn.restype, fn.argtypes = ctypes.c_uint64, [ctypes.c_char_p, ctypes.c_size_t]
    if fn(b"faultfs", 7) != xxhash.xxh3_64_intdigest(b"faultfs"):
        return None  # not the function it claims to be
    return ctypes.cast(fn, ctypes.c_void_p).value


class FastReads:
    """The fast read path of one mount (``start`` makes it, ``stop`` ends it)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._stats = engine.stats
        self._enabled: set[int] = set()
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Run the bookkeeping, and open ahead the staged blobs of tags as they are enabled."""
        self._nursery = nursery
        nursery.start_soon(self.harvest_forever)

    @staticmethod
    def prepare(config: Config) -> bool:
        """Before ``pyfuse3.init``: have the session's device read by the compiled piece's
        threads (when the mount stages blobs and the piece is there)."""
        if not (config.fast_read and config.store_enabled) or native is None:
            return False
        if xxh3_address() is None:
            log.warning("staged reads go through pyfuse3: python-xxhash's XXH3_64bits not found")
            return False
        try:
            native.prepare(config.fast_read_threads)
        except ValueError as exc:  # Config bounds it as the piece does; never fail a mount
            log.warning("staged reads go through pyfuse3: %s", exc)
            return False
        return True

    @classmethod
    def start(cls, engine: Engine) -> FastReads | None:
        """Start answering staged reads, or None where the device is pyfuse3's own."""
        if native is None or native.queue_fd() < 0:
            return None
        address = xxh3_address()
        assert address is not None  # prepare looked
        native.start(address, INDEX_BITS, KIND_BITS, KIND_CHUNK, KIND_VIEW)
        fast = cls(engine)
        engine.watch_writes(fast.tag_changed)
        engine.before_snapshot.append(fast.harvest)
        engine.tiers.local.requests_wait_in(native.queue_fd())
        engine.tiers.local.watch(fast)
        return fast

    @staticmethod
    def queue_fd() -> int | None:
        """The descriptor pyfuse3 waits on, when the compiled piece reads the device."""
        fd = -1 if native is None else native.queue_fd()
        return fd if fd >= 0 else None

    # -- what may be served ------------------------------------------------------------------

    def opened(self, key: BlobKey, blob: OpenBlob) -> None:
        """The local tier holds ``blob`` open: serve reads of it (a clean, verified file)."""
        h = blob.header
        if blob.loaded is not None or h.dirty:
            return
        sums = h.block_sums if isinstance(h.block_sums, array.array) else array.array(
            "Q", h.block_sums)
        try:
            native.publish(key[0], key[1], blob.fd, HEADER_LEN, h.payload_len, h.stored_len,
                           h.block_size, sums, h.all_zero)
        except (OSError, MemoryError, ValueError) as exc:  # EMFILE; a key past its bounds…
            log.debug("blob %s not served by the fast read path: %s", key, exc)

    def closed(self, key: BlobKey) -> None:
        """The local tier let the file go: no read here may use it from now on."""
        native.unpublish(*key)

    def forgot(self, tag_id: int) -> None:
        self.tag_changed(tag_id)

    def tag_changed(self, tag_id: int) -> None:
        """The tag has (or may have) writes: its reads are the engine's from now on. May be
        called from a pool thread (a clone's write state is opened there): the C side takes
        its own lock, and ``file_opened`` looks at ``has_writes_path`` again after enabling."""
        native.disable_tag(tag_id)
        self._enabled.discard(tag_id)

    def file_opened(self, handle) -> None:
        """A chunk or the view of a tag was opened: serve it here while the tag is clean."""
        tag = getattr(handle, "tag", None)
        if tag is None or getattr(handle, "kind", None) not in (KIND_CHUNK, KIND_VIEW):
            return
        if tag.id in self._enabled or tag.id >= 1 << 31:
            return
        if self.engine.has_writes_path(tag):
            return
        layout = tag.layout
        try:
            # a clone's clean chunks are its ancestor's blobs, published under that tag's id
            native.set_tag(tag.id, layout.chunk_size, layout.size, layout.num_blobs, True,
                           tag.clean.id)
        except MemoryError:
            return
        if self.engine.has_writes_path(tag):  # given writes meanwhile (a pool thread)
            native.disable_tag(tag.id)
            return
        self._enabled.add(tag.id)
        if self._nursery is not None:  # first reads of its staged blobs go to C as well
            self._nursery.start_soon(self._open_ahead, tag.clean.id)

    async def _open_ahead(self, tag_id: int) -> None:
        opened = await self.engine.tiers.local.open_ahead(tag_id)
        if opened:
            log.debug("tag %d: %d staged blob(s) opened ahead for the fast read path",
                      tag_id, opened)

    # -- the bookkeeping ---------------------------------------------------------------------

    async def harvest_forever(self) -> None:
        while True:
            await trio.sleep(HARVEST_S)
            self.harvest()

    def harvest(self) -> None:
        """Count the reads served since the last harvest and touch their blobs in the LRU."""
        touched, counts = native.harvest()
        local = self.engine.tiers.local
        for tag_id, index, _hits in touched:
            local.touch((tag_id, index))
        add = self._stats.add
        if counts["reads"]:
            add("reads", counts["reads"])
            add("hits", counts["reads"])
            add("bytes_served", counts["bytes"])
            add("fast_reads", counts["reads"])
        if counts["forwarded"]:
            add("fast_passed", counts["forwarded"])

    def stop(self) -> None:
        """Answer no read here any more (the threads go on passing requests to pyfuse3 until
        the session ends); the mount's tables go."""
        self.engine.tiers.local.watch(None)
        self.engine.watch_writes(None)
        native.stop()
        self.harvest()  # what was served up to the end (harvest still reads the counts)
        if self.harvest in self.engine.before_snapshot:
            self.engine.before_snapshot.remove(self.harvest)
