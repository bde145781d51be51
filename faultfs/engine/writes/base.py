"""The clean base under a partial write: the source's chunk a write lies over, faulted (the
size-0 request) and pinned while writes lie over it, read through the engine's clean path.

Invariants:
- The source is never written. A partial write of a chunk that is not staged issues its fault
  before it is answered; a write of a whole chunk does not. The write waits for neither the
  fault (it runs behind, ``BASE_FAULTS`` at once; past that, or without a nursery, the write
  faults it itself) nor the faulted chunk's store write: the base is the source's bytes
  either way, read through the clean path until it is staged and pinned; one the store could
  not keep is clean bytes that a later read faults again, or held by the blob
  (``base_bytes``) when the write faulted it inline (docs/decisions.md).
- A staged copy is pinned while writes lie over it and no longer: a base fault that lands
  after its blob was reset, folded, written whole or its write refused lets its pin go, and
  so does a refused first write (``refused``); the table lets it go when a chunk leaves its
  CLEAN base.
- A base that cannot be read because the source changed before it was staged makes its blob
  damaged (kept, EIO), never the writes laid over the new version's bytes (``lost``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from faultfs.engine.faults import Faulter
from faultfs.engine.tags import Tag
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.table import CLEAN, DirtyBlob, DirtyTable, bare
from faultfs.stats import Stats
from faultfs.tiers.base import BlobKey, Buffer
from faultfs.tiers.multilevel import TierStack

log = logging.getLogger("faultfs.writes")
BASE_FAULTS = 16  # size-0 requests at once behind the writes that issued them


class CleanReads(Protocol):
    """What writes need of the engine's clean path (``CleanPath``; a test may stand in)."""

    async def read_clean(self, tag: Tag, index: int, off: int, size: int) -> Buffer: ...

    async def stage_clean(self, tag: Tag, index: int) -> Buffer | None:
        """Fault chunk ``index`` if needed and pin its staged copy; its bytes when it could
        not be kept in the store (the caller then holds them)."""
        ...

    def pin_staged(self, tag: Tag, index: int) -> bool:
        """Pin chunk ``index``'s staged copy when there is one (nothing awaited)."""
        ...

    def pin(self, tag: Tag, index: int) -> None:
        """Pin chunk ``index``'s staged copy, now or whenever a fault stores it."""
        ...

    def unpin(self, tag: Tag, index: int) -> None: ...


class CleanPath:
    """The engine's clean path as the writes see it: its reads (``read``: the engine's hit,
    join or fault), the size-0 request over its tiers and faults, and the pins.

    A clone's clean chunk is its ancestor's staged blob (``Tag.clean``), so the pins of
    several tags may fall on one blob: it stays pinned while any of them holds it."""

    def __init__(self, tiers: TierStack, faults: Faulter,
                 read: Callable[[Tag, int, int, int], Awaitable[Buffer]]) -> None:
        self._tiers = tiers
        self._faults = faults
        self._read = read
        self._holders: dict[BlobKey, set[int]] = {}  # a pinned blob -> the tags pinning it

    async def read_clean(self, tag: Tag, index: int, off: int, size: int) -> Buffer:
        return await self._read(tag, index, off, size)

    async def stage_clean(self, tag: Tag, index: int) -> Buffer | None:
        """The size-0 request: fault the chunk if it is not staged, and pin the staged copy."""
        tiers = self._tiers
        key = (tag.clean.id, index)
        local = tiers.local
        if not local.contains(key):
            # a fault's copy in memory (or awaiting its store write) is the base already: a
            # read-modify-write (numpy.memmap r+) reads the source once, not twice
            data = tiers.held(key)
            if data is None:
                data = await self._faults.fault(tag.clean, index)
            if tiers.stage_behind(key, data):
                # The write goes on now: its base is held until stored, and a base the store
                # could not keep is clean bytes a later read faults again (never dirty data)
                self.pin(tag, index)
                return None
            with trio.move_on_after(30):  # the fault's own store write, behind it: not twice
                await tiers.wait_stored(key)
            if not local.contains(key):
                await local.put(key, data)
            if not local.contains(key):
                return bytes(data)  # the store could not keep it: the writes hold it
        self.pin(tag, index)
        return None

    def pin_staged(self, tag: Tag, index: int) -> bool:
        if not self._tiers.local.contains((tag.clean.id, index)):
            return False
        self.pin(tag, index)
        return True

    def pin(self, tag: Tag, index: int) -> None:
        key = (tag.clean.id, index)
        self._holders.setdefault(key, set()).add(tag.id)
        self._tiers.local.pin(key)

    def unpin(self, tag: Tag, index: int) -> None:
        key = (tag.clean.id, index)
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(tag.id)
            if holders:
                return  # another tag's writes still lie over it
            del self._holders[key]
        self._tiers.local.unpin(key)

    def release(self, tag: Tag) -> None:
        """``tag`` is forgotten: the pins it held go (its own blobs' with it)."""
        for key, holders in list(self._holders.items()):
            holders.discard(tag.id)
            if key[0] == tag.id:
                del self._holders[key]  # the tiers forgot them
            elif not holders:
                del self._holders[key]
                self._tiers.local.unpin(key)


class Bases:
    """The clean bases of partially written chunks; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, clean: CleanReads, damage: Damage,
                 stats: Stats) -> None:
        self.table = table
        self.clean = clean
        self.damage = damage
        self.stats = stats
        self.nursery: trio.Nursery | None = None
        self.faults = 0  # size-0 requests running behind the writes that issued them

    def unstaged(self, blob: DirtyBlob) -> bool:
        """Whether a partial write of ``blob`` needs its base first: it lies over its source
        chunk with nothing held or written (its fault not asked for yet)."""
        return blob.base is CLEAN and blob.base_bytes is None and not blob.pending

    def behind(self, blob: DirtyBlob, off: int, size: int) -> bool:
        """The size-0 request of a partial write, when the write need not wait for it: the
        chunk's staged copy is pinned now, or its fault is started behind the write (at most
        ``BASE_FAULTS`` at once; past that, and without a nursery, the write waits for it).
        The write is journaled over a base that is the source's bytes either way: a read or a
        fold meanwhile faults it through the same flight, and a fault that fails is EIO to
        them (never zeros) while the write itself stays acknowledged."""
        if off == 0 and size >= blob.size:
            return False  # a whole blob: no base at all (set under the lock, by the writer)
        assert blob.index is not None
        if self.clean.pin_staged(blob.tag, blob.index):
            return True
        if self.nursery is None or self.faults >= BASE_FAULTS:
            return False
        self.faults += 1
        self.nursery.start_soon(self._fault, blob.tag, blob.index, blob.name)
        return True

    async def stage(self, blob: DirtyBlob) -> Buffer | None:
        """Fault ``blob``'s base now (the writer waits) and pin it; its bytes when the store
        could not keep them."""
        assert blob.index is not None
        return await self.clean.stage_clean(blob.tag, blob.index)

    def staged_for(self, blob: DirtyBlob, now: DirtyBlob, kept: Buffer | None) -> None:
        """A write staged ``blob``'s base, then found a reset had dropped ``blob`` and the
        tables hold ``now`` under its name: the pin (and the bytes) are ``now``'s base when
        it lies over that chunk still; else the pin goes."""
        assert blob.index is not None
        if now.base is CLEAN and not now.damaged:
            if now.base_bytes is None:
                self.table.set_base_bytes(now, kept)
        else:
            self.clean.unpin(blob.tag, blob.index)

    def refused(self, blob: DirtyBlob) -> None:
        """The first write over ``blob``'s base was refused (ENOSPC): when nothing lies over
        the base, the pin the write took (or its fault will take) goes, so a chunk no write
        changed stays evictable."""
        if blob.index is not None and bare(blob):
            self.table.set_base_bytes(blob, None)
            self.clean.unpin(blob.tag, blob.index)

    async def _fault(self, tag: Tag, index: int, name: str) -> None:
        try:
            kept = await self.clean.stage_clean(tag, index)
        except Exception as exc:  # a background task must never take the mount down
            self.stats.add("base_fault_errors")
            log.warning("faulting chunk %d of tag %s beneath a write failed (a read of it "
                        "faults it again): %s", index, tag.name, exc)
            blob = self.table.blobs.get((tag.id, name))
            if blob is not None:
                await self.lost(blob)
            return
        finally:
            self.faults -= 1
        # nothing awaited from the pin on: the blob is as it is now
        blob = self.table.blobs.get((tag.id, name))
        if blob is None or blob.base is not CLEAN or bare(blob):
            # reset, folded or rewritten whole meanwhile, or its write refused (ENOSPC)
            self.clean.unpin(tag, index)
        elif kept is not None and blob.base_bytes is None:
            self.table.set_base_bytes(blob, kept)

    async def read(self, blob: DirtyBlob, off: int, size: int) -> Buffer:
        """Bytes of ``blob``'s clean base: held, or through the clean path (faulted, verified,
        single-flight), pinned once the store has them while writes lie over them."""
        base_bytes = blob.base_bytes
        if base_bytes is not None:
            return memoryview(base_bytes)[off:off + size]
        assert blob.index is not None
        data = await self.clean.read_clean(blob.tag, blob.index, off, size)
        if blob.base is CLEAN and blob.pending:  # (a fault behind a write that failed, a
            # replay): kept once the store has it; a chunk nothing was written over (a
            # refused write's) stays evictable
            self.clean.pin(blob.tag, blob.index)
        return data

    async def lost(self, blob: DirtyBlob) -> bool:
        """Whether ``blob``'s writes lie over source bytes that cannot be read any more: the
        source changed under the mount before its base was staged. Then it is damaged (kept,
        EIO), never its writes laid over the new version's bytes."""
        why = lost_why(blob, blob.tag.changed_under_mount)
        if why:
            await self.damage.mark(blob, why)
        return bool(why)


def lost_why(blob: DirtyBlob, change: str) -> str:
    """Why ``blob``'s base is gone when the source changed (``change``: how); "" when it is
    not (no change, no clean base under it, or written over whole)."""
    if (not change or blob.damaged or blob.base is not CLEAN or blob.base_bytes is not None
            or not blob.pending or blob.pending.covers(0, blob.size)):
        return ""
    return (f"its writes lie over the source's bytes of chunk {blob.index}, which were not "
            f"staged before the source changed ({change}): kept, never laid over the new "
            "version")
