"""User blobs: files created in a tag directory, renamed and unlinked — changes of the tag's
user blob table (names to ids; ``state.py``), saved durably before they are answered.

Invariants:
- A user blob's dirty files are named by its id (``u:<id>``, ``u:<id>.<part>``): a rename
  or an exchange is one table update, never a copy; an id is never handed out twice.
- A table change holds its tag's state lock from its check to its save: a reset under way
  (which may fail and put the table back) is done first. One whose save fails changes
  nothing, in memory as on disk (the table is put back and saved once more, best effort).
- An unlinked (or replaced) user blob's dirty blobs leave the table, and their files are
  deleted, once the state saying it is gone is durable.
- Every call is one change of its tag (``one_change``).
"""

from __future__ import annotations

import errno

from faultfs.core.names import PAGE_PREFIX, PAGEMAP_NAME, check_name
from faultfs.engine.changes import TagChanges, one_change
from faultfs.engine.tags import Tag
from faultfs.engine.writes.state import TagStates, TagWrites
from faultfs.engine.writes.table import NEW, DirtyBlob, DirtyTable, chunk_index, part_name
from faultfs.errors import FaultfsError
from faultfs.iopool import IoPool
from faultfs.store.dirty import DirtyFiles


class UserBlobs:
    """The user blob tables of an engine's tags; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, files: DirtyFiles, pool: IoPool,
                 changes: TagChanges) -> None:
        self.table = table
        self.states = states
        self.files = files
        self.pool = pool
        self.changes = changes  # (``one_change``)

    def check_name(self, tag: Tag, name: str) -> None:
        """A user blob may not take the name of anything the tag shows already."""
        check_name(name, "blob name")
        if (name == tag.view_name or name == PAGEMAP_NAME or name.startswith(PAGE_PREFIX)
                or chunk_index(tag, name) is not None):
            raise FaultfsError(f"{name} names an entry of tag {tag.name}", errno.EPERM)

    @one_change
    async def create(self, tag: Tag, name: str) -> None:
        self.states.check_writable(tag)
        self.check_name(tag, name)
        async with self.states.lock(tag.id):
            tw = self.states.of(tag)
            if name in tw.users:
                raise FaultfsError(f"blob {name} of tag {tag.name} exists", errno.EEXIST)
            before = dict(tw.users), set(tw.parted)
            uid = tw.next_user
            tw.next_user += 1  # (kept past a failed save: an id is never handed out twice)
            tw.users[name] = uid
            tw.parted.add(uid)
            await self._save(tag, tw, *before)
            self.table.add(DirtyBlob(tag, part_name(uid, 0), None, 0, NEW))

    @one_change
    async def unlink(self, tag: Tag, name: str) -> None:
        self.states.check_writable(tag)
        async with self.states.lock(tag.id):
            tw = self.states.of(tag)
            before = dict(tw.users), set(tw.parted)
            uid = tw.users.pop(name, None)
            if uid is None:
                raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
            tw.parted.discard(uid)
            await self._save(tag, tw, *before)
        await self._drop(tag, uid)

    @one_change
    async def rename(self, tag: Tag, old: str, new: str, *, replace: bool = True) -> None:
        """Rename a user blob (replacing a user blob named ``new``; with ``replace`` False,
        EEXIST when there is one): one table update."""
        self.states.check_writable(tag)
        self.check_name(tag, new)
        async with self.states.lock(tag.id):
            tw = self.states.of(tag)
            if old not in tw.users:
                raise FaultfsError(f"tag {tag.name} has no blob {old}", errno.ENOENT)
            if not replace and new in tw.users:
                raise FaultfsError(f"blob {new} of tag {tag.name} exists", errno.EEXIST)
            before = dict(tw.users), set(tw.parted)
            replaced = tw.users.pop(new, None)
            tw.users[new] = tw.users.pop(old)
            if replaced is not None:
                tw.parted.discard(replaced)
            await self._save(tag, tw, *before)
        if replaced is not None:
            await self._drop(tag, replaced)

    @one_change
    async def exchange(self, tag: Tag, a: str, b: str) -> None:
        """Swap two user blobs' names (renameat2's RENAME_EXCHANGE): one table update, saved
        as a rename's is, so the swap survives a crash whole or not at all. ENOENT unless
        both exist; nothing is dropped."""
        self.states.check_writable(tag)
        async with self.states.lock(tag.id):
            tw = self.states.of(tag)
            for name in (a, b):
                if name not in tw.users:
                    raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
            before = dict(tw.users), set(tw.parted)
            tw.users[a], tw.users[b] = tw.users[b], tw.users[a]
            await self._save(tag, tw, *before)

    async def _save(self, tag: Tag, tw: TagWrites, users: dict[str, int],
                    parted: set[int]) -> None:
        """Save a change of ``tag``'s user blob table (its state lock held), or, when the
        save fails, put the table back as it was (``users``, ``parted``: copies from before
        the change) and save that once more, best effort (a save whose directory fsync
        failed may have replaced the file): a change the caller was told failed is not kept
        in memory, where the tag's next state save would write it."""
        try:
            await self.states.write(tag.id)
        except BaseException as exc:
            tw.users, tw.parted = users, parted
            if isinstance(exc, FaultfsError):  # (cancelled: the save never started)
                await self.states.write_again(tag, "the user blob table before the failed "
                                              "change")
            raise

    async def _drop(self, tag: Tag, uid: int) -> None:
        """Forget the dirty blobs of user blob ``uid`` (unlinked, or replaced by a rename)
        and delete their files (the state saying it is gone is durable already)."""
        names = {self.table.forget((tag.id, b.name)).name
                 for b in list(self.table.parts(tag, uid).values())}
        for name in names:  # gone: nothing damaged is kept of it (its kept records stay)
            self.states.tags[tag.id].damaged_blobs.pop(name, None)
        # and the first part's name in any case: an empty blob folded before any record was
        # appended names seq 0, which a mount does not load (its file is only deleted here)
        names.add(part_name(uid, 0))

        def delete() -> None:
            for name in sorted(names):
                self.files.delete(tag.name, name)

        await self.pool.run(delete)
