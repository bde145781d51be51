"""The dirty-blob table: every dirty blob of the mount by key, and the only code that changes a
blob's base, the written bytes held in memory and the counts kept of them.

A dirty blob's bytes are a base with the writes since its last fold laid over it (``pending``,
an ``ExtentMap``). Its base (``Base``) and the data that belongs to each:

- CLEAN: the source's chunk beneath (staged and pinned, or read through the clean path);
  ``base_bytes`` holds it when the store could not keep it.
- FOLDED: its dirty file (``store/dirty.py``); ``folded_size`` is that file's payload length.
- NEW: nothing beneath (past the source, a user blob's part, a page gap, a chunk zeroed whole).
- DIRECT: direct file ``direct`` (a chunk written whole), nothing over it when it was set.

``folded_seq`` is the last journal record the blob's dirty file includes, whatever its base:
the file stays under a direct file until a fold replaces it, and a replay or a trim keeps
the records after it.

Invariants:
- ``held`` is the sum of ``pending.held`` over the blobs in the table, and ``direct_count``
  the number of them whose base is DIRECT; only the transitions below change a blob's base,
  its pending writes or these sums. A blob taken out (a reset, an unlink, a refused write)
  takes its held bytes and its count with it; one put back brings them (``add``). What is
  done to a blob out of the table (a reset's, while it is merged) is counted by ``add``.
- A chunk that leaves its CLEAN base (written or zeroed whole, folded, taken out) lets its
  source chunk's pin go (``unpin``): nothing lies over that copy any more.
- A DIRECT base left for another (written whole again, folded by a copy, merged away) puts its
  file in ``obsolete``: a record may still name it until the journal is trimmed past it.
- ``changed`` holds the tags with writes (their views take the writes' path); ``on_change``
  is told, synchronously, before the change is seen.
- ``touched`` and ``fold_work``: the blobs written since the last checkpoint and their sizes,
  what the next one rewrites.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field

import trio

from faultfs.core.extents import ExtentMap, Ref
from faultfs.core.names import parse_index
from faultfs.engine.tags import Tag
from faultfs.tiers.base import Buffer

USER_PREFIX = "u:"  # dirty files of user blobs are named by id: a rename is a table update
USER_PART = 1 << 20  # a user blob is cut into dirty blobs of this size: u:<id>, u:<id>.1, ...
GAP_PREFIX = ".pagegap."  # bytes written into the gaps of page N (hidden, never listed)
VIEW = ""  # the journal's name for a tag's whole-object view (its size records)
SPILL_RECORD = 1 << 20  # data of records up to this is spilled; longer ones are folded


class Base(enum.Enum):
    """What lies beneath a dirty blob's writes (the module docstring says each one's data)."""

    CLEAN = "clean"
    FOLDED = "folded"
    NEW = "new"
    DIRECT = "direct"


CLEAN, FOLDED, NEW, DIRECT = Base.CLEAN, Base.FOLDED, Base.NEW, Base.DIRECT


@dataclass(eq=False)
class DirtyBlob:
    tag: Tag
    name: str  # its name in the journal and the dirty files: a chunk's, "u:<id>", ".pagegap.N"
    index: int | None  # a chunk's index
    size: int  # payload bytes
    base: Base  # set by the table's transitions only
    folded_seq: int = 0  # the last journal record its dirty file includes
    folded_size: int = -1  # FOLDED: its dirty file's payload length (a resize changes size)
    direct: int = 0  # DIRECT: the seq of its direct file (and of the record naming it)
    pending: ExtentMap = field(default_factory=ExtentMap)
    base_bytes: Buffer | None = None  # CLEAN: the source's chunk the store could not keep
    lock: trio.Lock | None = None
    damaged: str = ""  # its dirty file cannot be read: reads and writes of it fail (EIO)
    writers: int = 0  # writes of it under way (a refused one lets go of a blob none holds)
    cut: int = -1  # the smallest size a resize gave it, -1: none (what shows of the blob a
    # failed reset put back beneath it)

    def locked(self) -> Holding:
        if self.lock is None:
            self.lock = trio.Lock()
        return Holding(self.lock)


class Holding:
    """``async with`` a lock that takes it at once when it is free: trio's ``acquire``
    passes through the scheduler even then, a few times per write."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        try:
            self.lock.acquire_nowait()
        except trio.WouldBlock:
            await self.lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


class DirtyTable:
    """The dirty blobs of an engine's tags; see the module docstring for the rules."""

    def __init__(self, unpin: Callable[[Tag, int], None]) -> None:
        self._unpin = unpin  # the clean path's: a source chunk no write lies over any more
        self.blobs: dict[tuple[int, str], DirtyBlob] = {}
        # (tag id, user blob id) -> its dirty blobs by part; and its size, when known
        self._parts: dict[tuple[int, int], dict[int, DirtyBlob]] = {}
        self._user_sizes: dict[tuple[int, int], int] = {}
        self.user_part = USER_PART  # (the writes model cuts smaller parts: few KiB test it all)
        self.changed: set[int] = set()  # ids of tags with writes: their views take this path
        # told (synchronously) each time a tag joins ``changed``, before the change is seen:
        # a reader of its own that skips the engine stops serving the tag's clean bytes
        self.on_change: Callable[[int], None] | None = None
        self.held = 0  # bytes of writes held in memory (ExtentMap.held summed)
        self._direct_count = 0  # blobs whose base is a direct file
        self.obsolete: list[tuple[str, int]] = []  # (tag, seq) of direct files to delete
        # (tag, name) of dirty files of blobs dropped (a reset, an unlink): deleted after the
        # next checkpoint saved the state without them, unless a blob has the name again
        self.doomed: list[tuple[str, str]] = []
        self.touched: set[tuple[int, str]] = set()  # blobs written since the last checkpoint
        self.fold_work = 0  # their sizes: what the next checkpoint rewrites, about

    @property
    def direct_count(self) -> int:
        """Blobs whose base is a direct file (a checkpoint renames them past a bound)."""
        return self._direct_count

    # -- in and out --------------------------------------------------------------------------

    def add(self, blob: DirtyBlob) -> DirtyBlob:
        """Put ``blob`` in the table (made now, or put back), its held bytes and count too."""
        self.blobs[(blob.tag.id, blob.name)] = blob
        user = user_key(blob.name) if blob.index is None else None
        if user is not None:
            self._parts.setdefault((blob.tag.id, user[0]), {})[user[1]] = blob
            self._user_sizes.pop((blob.tag.id, user[0]), None)
        self.held += blob.pending.held
        if blob.base is DIRECT:
            self._direct_count += 1
        self.mark_changed(blob.tag.id)
        return blob

    def forget(self, key: tuple[int, str]) -> DirtyBlob:
        """Take dirty blob ``key`` out of the table: its held bytes, its count, and the pin of
        its source chunk go with it."""
        blob = self.blobs.pop(key)
        self.held -= blob.pending.held
        if blob.base is DIRECT:
            self._direct_count -= 1
        elif blob.base is CLEAN and blob.index is not None:
            self._unpin(blob.tag, blob.index)
        user = user_key(blob.name) if blob.index is None else None
        if user is not None:
            parts = self._parts.get((key[0], user[0]), {})
            parts.pop(user[1], None)
            if not parts:
                self._parts.pop((key[0], user[0]), None)
            self._user_sizes.pop((key[0], user[0]), None)
        return blob

    def chunk_blob(self, tag: Tag, index: int) -> DirtyBlob:
        """Chunk ``index``'s dirty blob, made (over the source's chunk, or nothing past it)
        when it has none."""
        name = tag.layout.blob_name(index)
        blob = self.blobs.get((tag.id, name))
        if blob is None:
            base = CLEAN if index < tag.layout.num_blobs else NEW
            blob = self.add(DirtyBlob(tag, name, index, tag.layout.chunk_size, base))
        return blob

    def user_part_blob(self, tag: Tag, uid: int, k: int) -> DirtyBlob:
        blob = self._parts.get((tag.id, uid), {}).get(k)
        if blob is None:
            blob = self.add(DirtyBlob(tag, part_name(uid, k), None, 0, NEW))
        return blob

    def gap_blob(self, tag: Tag, page: int) -> DirtyBlob:
        key = (tag.id, f"{GAP_PREFIX}{page}")
        blob = self.blobs.get(key)
        return self.add(DirtyBlob(tag, key[1], None, 0, NEW)) if blob is None else blob

    def blob_for(self, tag: Tag, name: str, users: Collection[int]) -> DirtyBlob | None:
        """The blob a journal record names, made as a replay makes it when the table has none;
        None when it is no blob of ours or gone (a user blob whose id is not in ``users``)."""
        blob = self.blobs.get((tag.id, name))
        if blob is not None:
            return blob
        if name.startswith(USER_PREFIX):
            user = user_key(name)
            if user is None or user[0] not in users:
                return None
            blob = DirtyBlob(tag, name, None, 0, NEW)
        elif name.startswith(GAP_PREFIX):
            blob = DirtyBlob(tag, name, None, 0, NEW)  # grows with what was written
        else:
            index = chunk_index(tag, name)
            if index is None:
                return None
            return self.chunk_blob(tag, index)
        return self.add(blob)

    # -- transitions of a blob's base --------------------------------------------------------

    def set_new(self, blob: DirtyBlob) -> None:
        """``blob`` no longer lies over its source chunk (written or zeroed whole): nothing
        beneath, and the staged copy is evictable again."""
        assert blob.base is CLEAN and blob.base_bytes is None, blob.base
        if blob.index is not None:
            self._unpin(blob.tag, blob.index)
        blob.base = NEW

    def set_direct(self, blob: DirtyBlob, seq: int) -> None:
        """``blob`` is now direct file ``seq`` whole: nothing under it or over it."""
        if blob.base is DIRECT:
            self.obsolete.append((blob.tag.name, blob.direct))  # a record may still name it
        else:
            self._direct_count += 1
            if blob.base is CLEAN and blob.index is not None:
                self._unpin(blob.tag, blob.index)
        self.held -= blob.pending.held
        blob.pending, blob.base_bytes = ExtentMap(), None
        blob.base, blob.direct = DIRECT, seq

    def set_folded(self, blob: DirtyBlob, seq: int, size: int, *, renamed: bool = False) -> None:
        """``blob`` is now its dirty file, which includes record ``seq`` and holds ``size``
        bytes: nothing over it. ``renamed``: the file is the blob's direct file, renamed (no
        copy: the direct file is not obsolete, it is this one)."""
        self.held -= blob.pending.held
        was = blob.base
        if was is DIRECT:
            if not renamed:  # its record stays in the journal until a trim
                self.obsolete.append((blob.tag.name, blob.direct))
            self._direct_count -= 1
        blob.base, blob.folded_seq, blob.folded_size = FOLDED, seq, size
        blob.pending, blob.base_bytes, blob.direct = ExtentMap(), None, 0
        if was is CLEAN and blob.index is not None:
            self._unpin(blob.tag, blob.index)

    def leave_direct(self, blob: DirtyBlob) -> int:
        """A damaged blob's direct file goes aside with its records: the blob is its older
        dirty file again, as a remount will see it. The direct file's seq."""
        assert blob.base is DIRECT and blob.damaged
        self._direct_count -= 1
        seq, blob.base, blob.direct = blob.direct, FOLDED, 0
        return seq

    def set_base_bytes(self, blob: DirtyBlob, data: Buffer | None) -> None:
        """The source's chunk beneath ``blob``, held because the store could not keep it (None:
        let go; its pin, if any, is the caller's)."""
        assert data is None or blob.base is CLEAN, blob.base
        blob.base_bytes = data

    # -- writes laid over a blob -------------------------------------------------------------

    def write(self, blob: DirtyBlob, off: int, data: bytes | Ref) -> None:
        """Lay a write over ``blob`` (a user blob or a gap grows with it; a chunk does not)."""
        pending = blob.pending
        before = pending.held
        pending.write(off, data)
        if blob.index is None:
            blob.size = max(blob.size, off + len(data))
        self.held += pending.held - before

    def zero(self, blob: DirtyBlob, off: int, length: int) -> None:
        before = blob.pending.held
        blob.pending.zero(off, length)
        self.held += blob.pending.held - before

    def resize(self, blob: DirtyBlob, size: int) -> None:
        before = blob.pending.held
        resize(blob, size)
        self.held += blob.pending.held - before

    def spill(self) -> int:
        """Let go of the bytes of every write held in memory (the journal has them): how
        many bytes were let go."""
        before = self.held
        for blob in self.blobs.values():
            if blob.pending.held:
                self.held -= blob.pending.spill(SPILL_RECORD)
        return before - self.held

    def touch(self, blob: DirtyBlob) -> None:
        """``blob`` was written: the next checkpoint rewrites it."""
        key = (blob.tag.id, blob.name)
        if key not in self.touched:
            self.touched.add(key)
            self.fold_work += max(blob.size, 1)

    def untouch_all(self) -> None:
        """A checkpoint begins: what is written from here on is the next one's work."""
        self.touched.clear()
        self.fold_work = 0

    # -- tags --------------------------------------------------------------------------------

    def mark_changed(self, tag_id: int) -> None:
        self.changed.add(tag_id)
        if self.on_change is not None:
            self.on_change(tag_id)

    def of_tag(self, tag_id: int) -> list[DirtyBlob]:
        return [b for (t, _), b in self.blobs.items() if t == tag_id]

    def is_dirty(self, tag: Tag, index: int) -> bool:
        return bool(self.blobs) and (tag.id, tag.layout.blob_name(index)) in self.blobs

    def dirty_chunks(self, tag: Tag) -> list[int]:
        """Indexes of the tag's dirty chunks, in order (one pass over the dirty blobs)."""
        return sorted(b.index for (tag_id, _), b in self.blobs.items()
                      if tag_id == tag.id and b.index is not None)

    def touches(self, tag: Tag, index: int) -> bool:
        """Whether a read of chunk ``index`` is the writes' (dirty, or past the source)."""
        return index >= tag.layout.num_blobs or self.is_dirty(tag, index)  # cheap when clean

    def damaged_names(self, tag: Tag) -> list[str]:
        """The damaged dirty blobs of a tag (EIO until a reset drops them)."""
        return sorted(b.name for (tag_id, _), b in self.blobs.items()
                      if tag_id == tag.id and b.damaged)

    def dirty_summary(self, tag: Tag) -> tuple[int, int]:
        """``(dirty blobs, bytes)`` of a tag (bytes: sizes of its dirty blobs)."""
        count = size = 0
        for (tag_id, _), blob in self.blobs.items():
            if tag_id == tag.id:
                count += 1
                size += blob.size
        return count, size

    # -- user blobs --------------------------------------------------------------------------

    def parts(self, tag: Tag, uid: int) -> dict[int, DirtyBlob]:
        """User blob ``uid``'s dirty blobs by part (read only)."""
        return self._parts.get((tag.id, uid), {})

    def user_size(self, tag: Tag, uid: int, parted: bool) -> int:
        """A user blob's size: its one dirty blob's, or where its last non-empty part ends."""
        key = (tag.id, uid)
        size = self._user_sizes.get(key)
        if size is None:
            parts = self._parts.get(key, {})
            if parted:
                size = max((k * self.user_part + b.size for k, b in parts.items() if b.size),
                           default=0)
            else:
                size = parts[0].size if 0 in parts else 0
            self._user_sizes[key] = size
        return size

    def user_held(self, tag: Tag, uid: int) -> int:
        """Bytes of the parts user blob ``uid`` has (a hole between its parts holds none)."""
        return sum(blob.size for blob in self._parts.get((tag.id, uid), {}).values())

    def set_user_size(self, tag: Tag, uid: int, size: int | None, *, grown: bool = False) -> None:
        """Note user blob ``uid``'s size (None: work it out again when asked; ``grown``: at
        least ``size``, when it is known)."""
        key = (tag.id, uid)
        if size is None:
            self._user_sizes.pop(key, None)
        elif not grown:
            self._user_sizes[key] = size
        elif key in self._user_sizes:
            self._user_sizes[key] = max(self._user_sizes[key], size)

    def user_changed(self, blob: DirtyBlob) -> None:
        """A part of a user blob changed size: its size is worked out again when asked."""
        if blob.index is None and blob.name.startswith(USER_PREFIX):
            user = user_key(blob.name)
            if user is not None:
                self._user_sizes.pop((blob.tag.id, user[0]), None)

    def __iter__(self) -> Iterator[DirtyBlob]:
        return iter(self.blobs.values())


def resize(blob: DirtyBlob, size: int) -> None:
    """Give ``blob`` size ``size`` (the caller counts what its pending writes hold)."""
    if size < blob.size:
        # regrown, the bytes past ``size`` read as zeros: the mask reaches as far as the
        # mask of an earlier shrink did (it lies past ``blob.size``, over base bytes that
        # are still in the folded file, and the cut would drop it)
        top = max(blob.size, blob.pending.end)
        blob.pending.cut(size)
        blob.pending.zero(size, top - size)
    blob.size = size
    blob.cut = size if blob.cut < 0 else min(blob.cut, size)


def bare(blob: DirtyBlob) -> bool:
    """Whether ``blob`` lies over its source chunk with nothing written over it (a pin of
    that chunk would only keep it from eviction)."""
    return blob.base is CLEAN and blob.index is not None and not blob.pending


def unwritten(blob: DirtyBlob) -> bool:
    """Whether ``blob`` is a chunk nothing was written to: its source chunk bare, or a chunk
    past the source with nothing in it (it reads as if it were not dirty)."""
    return bare(blob) or (blob.base is NEW and blob.index is not None
                          and blob.index >= blob.tag.layout.num_blobs and not blob.pending)


def chunk_index(tag: Tag, name: str) -> int | None:
    prefix = tag.layout.blob_prefix
    return parse_index(name[len(prefix):]) if name.startswith(prefix) else None


def part_name(uid: int, k: int) -> str:
    """The dirty blob of part ``k`` of user blob ``uid`` (part 0's is the blob's old name)."""
    return f"{USER_PREFIX}{uid}" if k == 0 else f"{USER_PREFIX}{uid}.{k}"


def user_key(name: str) -> tuple[int, int] | None:
    """``(user blob id, part)`` of a user blob's dirty blob name, None for any other."""
    if not name.startswith(USER_PREFIX):
        return None
    uid, dot, part = name[len(USER_PREFIX):].partition(".")
    a, b = parse_index(uid), (parse_index(part) if dot else 0)
    return None if a is None or b is None or (dot and b == 0) else (a, b)


def void_key(name: str) -> str:
    """The name a reset marks for ``name``: a user blob's first part for every part."""
    user = user_key(name)
    return name if user is None else part_name(user[0], 0)
