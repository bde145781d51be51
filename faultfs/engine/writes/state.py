"""Per-tag write state: what a tag's writes changed beyond its blobs (the view's size, the user
blob table, reset marks, damaged blobs; ``store/writestate.py`` is its format), and its saves.

Invariants:
- A tag's state saves run one at a time (its state lock).
- A state is saved as it is in memory, which holds every change of the tag's table whose
  record was appended (a view size, a user blob made, renamed or unlinked, a reset: each is
  made right after its append, nothing awaited between); so a save names the journal's last
  seq as the one it includes (``view_seq``), and a replay makes only the table's changes
  past it. The blobs' own records go by their dirty files' seqs, not by this one.
- A state that could not be read (``damaged``) is never written over: fsck reports it, the
  user decides; its tag takes no writes (EIO).
- A tag nothing was written to has no state (none is made for it until it is written).
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from faultfs.core.names import is_hidden
from faultfs.engine.tags import Tag
from faultfs.engine.writes.table import DirtyTable, Holding
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.store.dirty import DirtyFiles
from faultfs.store.writestate import WriteState

DEFAULT_MODE = 0o644  # a user blob's mode when it was made without one
DIR_MODE = 0o755  # a tag directory's until a chmod

log = logging.getLogger("faultfs.writes")


@dataclass
class TagWrites(WriteState):
    """A tag's write state (``WriteState``), and what a mount keeps of it in memory only."""

    damaged: str = ""  # why its write state could not be read: it takes no writes


class TagStates:
    """The write states of an engine's tags; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, files: DirtyFiles, pool: IoPool,
                 last_seq: Callable[[], int], *, writable: bool) -> None:
        self.table = table
        self.files = files
        self.pool = pool
        self._last_seq = last_seq  # the journal's: what a state saved now includes
        self.writable = writable  # False: --read-only, --no-store, a degraded store
        self.tags: dict[int, TagWrites] = {}
        self.names: dict[int, str] = {}  # tag id -> name, for the state files
        # tags whose state the next checkpoint saves though they have no writes now (a reset
        # dropped them all: its void mark must be saved before the journal lets it go)
        self.unsaved: set[int] = set()
        self._locks: dict[int, trio.Lock] = {}
        self.changed_ns: dict[int, int] = {}  # tag id -> last chmod/utimensat of a user blob

    def of(self, tag: Tag) -> TagWrites:
        """``tag``'s write state, made (the source's size, nothing else) when it has none."""
        tw = self.tags.get(tag.id)
        if tw is None:
            tw = self.tags[tag.id] = TagWrites(view_size=tag.layout.size)
            self.names[tag.id] = tag.name
        return tw

    def forget(self, tag: Tag) -> str:
        """Drop ``tag``'s state from memory; the name its files go by."""
        self.tags.pop(tag.id, None)
        return self.names.pop(tag.id, tag.name)

    def check_writable(self, tag: Tag) -> None:
        """EROFS on a mount that takes no writes, EIO on a tag whose state is damaged."""
        if not self.writable:
            raise FaultfsError("this mount is read-only", errno.EROFS)
        tw = self.tags.get(tag.id)
        if tw is not None and tw.damaged:
            raise FaultfsError(f"tag {tag.name} takes no writes: its write state is damaged "
                               f"({tw.damaged}); run faultfs fsck", errno.EIO)

    # -- what a tag shows --------------------------------------------------------------------

    def view_size(self, tag: Tag) -> int:
        tw = self.tags.get(tag.id)
        return tag.layout.size if tw is None else tw.view_size

    def num_chunks(self, tag: Tag) -> int:
        """Chunks of the tag: the source's, and those the view grew past it."""
        cs = tag.layout.chunk_size
        return max(tag.layout.num_blobs, -(-self.view_size(tag) // cs))

    def mtime_ns(self, tag: Tag) -> int:
        tw = self.tags.get(tag.id)
        return 0 if tw is None else tw.mtime_ns

    def written(self, tag: Tag, uid: int | None = None) -> None:
        """``tag`` was written now (through user blob ``uid``: its mtime moves too)."""
        tw = self.of(tag)
        tw.mtime_ns = now = time.time_ns()
        if uid is not None:
            attrs = tw.user_attrs.get(uid)
            if attrs is None:
                tw.user_attrs[uid] = [DEFAULT_MODE, now, now]
            else:
                attrs[2] = now

    def dir_mode(self, tag: Tag) -> int:
        """The tag directory's mode bits (0755 until a ``chmod``)."""
        tw = self.tags.get(tag.id)
        return DIR_MODE if tw is None or tw.dir_mode is None else tw.dir_mode

    async def set_dir_mode(self, tag: Tag, mode: int) -> None:
        """``chmod`` of the tag directory, saved before it is answered (or nothing changes)."""
        self.check_writable(tag)
        tw = self.of(tag)
        before, tw.dir_mode = tw.dir_mode, mode & 0o7777
        try:
            await self.save(tag.id)
        except BaseException:
            tw.dir_mode = before
            raise

    def user_attrs(self, tag: Tag, uid: int) -> tuple[int, int, int, int]:
        """User blob ``uid``'s ``(mode bits, atime_ns, mtime_ns, ctime_ns)``; one made before
        blobs had their own (a version-1 state) is 0644 at the tag's time. The change time
        is never before the last change of the tag's writes or modes and times this mount
        saw (not kept: after a remount it is the tag's last write), so a tool that trusts it
        (a backup's file cache) never takes a blob as unchanged when its times were set back."""
        tw = self.tags.get(tag.id)
        attrs = None if tw is None else tw.user_attrs.get(uid)
        written = max(int(tag.mtime * 1e9), self.mtime_ns(tag))
        if attrs is None:
            return DEFAULT_MODE, written, written, written
        mode, atime, mtime = attrs
        return mode, atime, mtime, max(mtime, written, self.changed_ns.get(tag.id, 0))

    def attrs_changed(self, tag: Tag) -> None:
        """A mode or times of ``tag``'s user blobs were set now (their change time moves)."""
        self.changed_ns[tag.id] = time.time_ns()

    def set_view_size(self, tag: Tag, tw: TagWrites, size: int) -> None:
        tw.view_size = size
        self.table.mark_changed(tag.id)

    def user_names(self, tag: Tag) -> list[str]:
        tw = self.tags.get(tag.id)
        return [] if tw is None else sorted(n for n in tw.users if not is_hidden(n))

    def user_id(self, tag: Tag, name: str) -> int | None:
        tw = self.tags.get(tag.id)
        return None if tw is None else tw.users.get(name)

    def user_name(self, tag: Tag, uid: int) -> str | None:
        tw = self.tags.get(tag.id)
        if tw is None:
            return None
        return next((n for n, i in tw.users.items() if i == uid), None)

    def user_uid(self, tag: Tag, name: str) -> int:
        """User blob ``name``'s id; ENOENT when the tag has none of that name."""
        uid = self.user_id(tag, name)
        if uid is None:
            raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
        return uid

    def dependents(self, tag: Tag) -> list[str]:
        """Clones made of ``tag`` (their dirty files began as links of its files)."""
        return sorted(self.names[tid] for tid, tw in self.tags.items()
                      if tid != tag.id and tag.name in tw.ancestors)

    # -- saves -------------------------------------------------------------------------------

    def lock(self, tag_id: int) -> Holding:
        """``async with`` it: ``tag_id``'s state saves wait (see the module docstring)."""
        lock = self._locks.get(tag_id)
        if lock is None:
            lock = self._locks[tag_id] = trio.Lock()
        return Holding(lock)

    async def save(self, tag_id: int) -> None:
        """Save a tag's write state as it is now."""
        async with self.lock(tag_id):
            await self.write(tag_id)

    async def write(self, tag_id: int) -> None:
        """Save a tag's write state as it is now (its state lock held)."""
        tw = self.tags[tag_id]
        if tw.damaged:
            return  # never written over: fsck reports it, the user decides
        name = self.names[tag_id]
        try:
            await self.pool.run(self.files.write_state, name, self._doc(tw))
        except OSError as exc:
            code = errno.ENOSPC if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errno.EIO
            raise FaultfsError(f"saving the writes of tag {name} failed: {exc.strerror}",
                               code) from None

    def write_now(self, tag_id: int) -> None:
        """Save a tag's write state now, blocking (before the mount answers); OSError."""
        tw = self.tags[tag_id]
        if not tw.damaged:
            self.files.write_state(self.names[tag_id], self._doc(tw))

    def _doc(self, tw: TagWrites) -> dict:
        """``tw`` as saved now: every record of the tag's table appended so far is in it."""
        tw.view_seq = self._last_seq()
        return tw.saved()
