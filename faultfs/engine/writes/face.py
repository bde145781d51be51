"""The face of the writes: what the engine calls, each call handed to the room whose duty it is.
It builds the rooms over one dirty-blob table and gives each the collaborators it needs.

Invariants:
- The face holds no state of its own: every rule is a room's, stated at the top of its
  module. A call here is handed on, or puts two rooms' answers together (a user blob's size:
  its id from the state, its parts from the table).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import trio

from faultfs.engine.changes import TagChanges
from faultfs.engine.tags import Tag
from faultfs.engine.writes.base import Bases, CleanReads
from faultfs.engine.writes.blobwrite import BlobWrites
from faultfs.engine.writes.checkpoint import FOLD_BYTES, JOURNAL_BYTES, Checkpoints
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.lifetime import TagLifetime
from faultfs.engine.writes.reads import DirtyReads
from faultfs.engine.writes.recovery import Recovery, TagLoad
from faultfs.engine.writes.reset import Resets
from faultfs.engine.writes.state import DEFAULT_MODE, TagStates, TagWrites
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import DirtyTable
from faultfs.engine.writes.users import UserBlobs
from faultfs.engine.writes.writing import Writing
from faultfs.iopool import IoPool
from faultfs.stats import Stats
from faultfs.store.dirty import DirtyFiles
from faultfs.store.fileops import FileOps
from faultfs.store.journal import Journal
from faultfs.tiers.base import Buffer


class Writes:
    """Copy-on-write over the read-only source for an engine's tags (DESIGN §11, §12)."""

    def __init__(self, root: str, clean: CleanReads, pool: IoPool, stats: Stats, *,
                 writable: bool, fold_bytes: int = FOLD_BYTES,
                 journal_bytes: int = JOURNAL_BYTES, ops: FileOps | None = None) -> None:
        self.writable = writable  # False: --read-only, --no-store, a degraded store
        self.files = files = DirtyFiles(root, ops, writable=writable)
        self.journal = journal = Journal(os.path.join(files.root, "journal"), ops)
        # every change of a tag is one (``one_change``): a clone holds its tag still
        self.changes = changes = TagChanges()
        self.table = table = DirtyTable(clean.unpin)
        self.changed = table.changed  # ids of tags with writes: their views take this path
        self.states = states = TagStates(table, files, pool, lambda: journal.last_seq,
                                         writable=writable)
        self.damage = damage = Damage(table, states, files, journal, pool)
        self.bases = bases = Bases(table, clean, damage, stats)
        self.sync = sync = GroupCommit(files, journal, pool, stats)
        self.reads = reads = DirtyReads(table, states, bases, clean, damage, files, journal,
                                        pool)
        self.checkpoints = checkpoints = Checkpoints(
            table, states, damage, bases, reads, sync, files, journal, pool, stats,
            fold_bytes=fold_bytes, journal_bytes=journal_bytes)
        self.writing = Writing(table, states, BlobWrites(table, states, bases, checkpoints,
                                                         sync, files, journal, stats), changes)
        self.users = users = UserBlobs(table, states, sync, journal, changes)
        self.resets = resets = Resets(table, states, sync, journal, changes)
        self.recovery = Recovery(table, states, damage, sync, checkpoints, clean, files,
                                 journal, users, resets)
        self.lifetime = TagLifetime(table, states, damage, checkpoints, sync, files, journal,
                                    pool, changes)

    # -- the table and the states ------------------------------------------------------------

    @property
    def held(self) -> int:
        """Bytes of writes held in memory."""
        return self.table.held

    @property
    def on_change(self) -> Callable[[int], None] | None:
        return self.table.on_change

    @on_change.setter
    def on_change(self, hook: Callable[[int], None] | None) -> None:
        """Told (synchronously) each time a tag joins ``changed``, before the change is seen."""
        self.table.on_change = hook

    @property
    def user_part(self) -> int:
        return self.table.user_part

    @user_part.setter
    def user_part(self, size: int) -> None:
        """The size user blobs are cut into (``USER_PART``; the writes model cuts smaller)."""
        self.table.user_part = size

    @property
    def tags(self) -> dict[int, TagWrites]:
        return self.states.tags

    def view_size(self, tag: Tag) -> int:
        return self.states.view_size(tag)

    def num_chunks(self, tag: Tag) -> int:
        return self.states.num_chunks(tag)

    def mtime_ns(self, tag: Tag) -> int:
        return self.states.mtime_ns(tag)

    def is_dirty(self, tag: Tag, index: int) -> bool:
        return self.table.is_dirty(tag, index)

    def dirty_chunks(self, tag: Tag) -> list[int]:
        return self.table.dirty_chunks(tag)

    def touches(self, tag: Tag, index: int) -> bool:
        return self.table.touches(tag, index)

    def damaged_names(self, tag: Tag) -> list[str]:
        return self.table.damaged_names(tag)

    def dirty_summary(self, tag: Tag) -> tuple[int, int]:
        return self.table.dirty_summary(tag)

    def user_names(self, tag: Tag) -> list[str]:
        return self.states.user_names(tag)

    def user_id(self, tag: Tag, name: str) -> int | None:
        return self.states.user_id(tag, name)

    def user_name(self, tag: Tag, uid: int) -> str | None:
        return self.states.user_name(tag, uid)

    def user_size(self, tag: Tag, name: str) -> int:
        uid = self.states.user_id(tag, name)
        if uid is None:
            return 0
        return self.table.user_size(tag, uid, uid in self.states.tags[tag.id].parted)

    def user_held(self, tag: Tag, name: str) -> int:
        uid = self.states.user_id(tag, name)
        return 0 if uid is None else self.table.user_held(tag, uid)

    def has_writes(self, tag: Tag) -> bool:
        return self.lifetime.has_writes(tag)

    def dependents(self, tag: Tag) -> list[str]:
        return self.states.dependents(tag)

    # -- recovery ----------------------------------------------------------------------------

    def open_tag(self, tag: Tag, loaded: TagLoad | None = None) -> None:
        self.recovery.open_tag(tag, loaded)

    def load_tag(self, tag: Tag) -> TagLoad:
        return self.recovery.load_tag(tag)

    def replay(self, tags: dict[str, Tag]) -> int:
        return self.recovery.replay(tags)

    def check_bases(self) -> None:
        self.recovery.check_bases()

    def needs_checkpoint(self) -> bool:
        return self.recovery.needs_checkpoint()

    # -- reads -------------------------------------------------------------------------------

    async def read_chunk(self, tag: Tag, index: int, off: int, size: int) -> bytes:
        return await self.reads.read_chunk(tag, index, off, size)

    async def read_view(self, tag: Tag, off: int, size: int) -> Buffer:
        return await self.reads.read_view(tag, off, size)

    async def read_user(self, tag: Tag, name: str, off: int, size: int) -> bytes:
        return await self.reads.read_user(tag, name, off, size)

    async def read_gap(self, tag: Tag, page: int, off: int, size: int) -> bytes | None:
        return await self.reads.read_gap(tag, page, off, size)

    # -- changes -----------------------------------------------------------------------------

    async def write_chunk(self, tag: Tag, index: int, off: int, data: bytes) -> int:
        return await self.writing.write_chunk(tag, index, off, data)

    async def write_view(self, tag: Tag, off: int, data: bytes) -> int:
        return await self.writing.write_view(tag, off, data)

    async def truncate_view(self, tag: Tag, size: int) -> None:
        await self.writing.truncate_view(tag, size)

    async def write_user(self, tag: Tag, name: str, off: int, data: bytes) -> int:
        return await self.writing.write_user(tag, name, off, data)

    async def truncate_user(self, tag: Tag, name: str, size: int) -> None:
        await self.writing.truncate_user(tag, name, size)

    async def write_gap(self, tag: Tag, page: int, off: int, data: bytes) -> None:
        await self.writing.write_gap(tag, page, off, data)

    def check_user_name(self, tag: Tag, name: str) -> None:
        self.users.check_name(tag, name)

    async def create_user(self, tag: Tag, name: str, mode: int = DEFAULT_MODE) -> None:
        await self.users.create(tag, name, mode)

    async def set_attrs(self, tag: Tag, name: str | None, mode: int | None,
                        atime_ns: int | None, mtime_ns: int | None) -> None:
        if name is None:
            if mode is not None:
                await self.states.set_dir_mode(tag, mode)
            return
        await self.users.set_attrs(tag, name, mode, atime_ns, mtime_ns)

    def attrs(self, tag: Tag, uid: int | None) -> tuple[int, int, int, int]:
        if uid is None:
            return self.states.dir_mode(tag), 0, 0, 0
        return self.states.user_attrs(tag, uid)

    async def unlink_user(self, tag: Tag, name: str) -> None:
        await self.users.unlink(tag, name)

    async def rename_user(self, tag: Tag, old: str, new: str, *, replace: bool = True) -> None:
        await self.users.rename(tag, old, new, replace=replace)

    async def hide_user(self, tag: Tag, name: str, uid: int) -> str:
        return await self.users.hide(tag, name, uid)

    async def exchange_users(self, tag: Tag, a: str, b: str) -> None:
        await self.users.exchange(tag, a, b)

    async def reset(self, tag: Tag, names: list[str] | None = None) -> int:
        return await self.resets.reset(tag, names)

    async def forget_tag(self, tag: Tag) -> None:
        await self.lifetime.forget_tag(tag)

    async def prepare_clone(self, parent: Tag, child: str) -> None:
        await self.lifetime.prepare_clone(parent, child)

    # -- durability --------------------------------------------------------------------------

    async def fsync(self) -> None:
        await self.sync.fsync()

    def attach(self, nursery: trio.Nursery) -> None:
        """Run base faults and checkpoints in ``nursery`` (the mount's), behind the writes."""
        self.bases.nursery = nursery
        self.checkpoints.nursery = nursery

    @property
    def base_faults(self) -> int:
        """Size-0 requests running behind the writes that issued them."""
        return self.bases.faults

    def start_checkpoint(self) -> None:
        self.checkpoints.start()

    async def checkpoint(self) -> None:
        await self.checkpoints.checkpoint()

    def spill(self) -> None:
        self.checkpoints.spill()

    async def close(self) -> None:
        """Unmount: everything written is folded and durable."""
        await self.checkpoints.close()
