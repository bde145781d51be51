"""User blobs: files created in a tag directory, renamed, exchanged and unlinked — changes of
the tag's user blob table (names to ids; ``state.py``), each one journal record.

Invariants:
- A change is answered once its record is appended and the journal synced (durable, as a
  state save made it before: one group commit for the changes that come together), and it
  is made in memory right after the append, with nothing awaited between: the table always holds every record appended. A replay makes each
  record's change with the same code (``made``, ``unlinked``, ``renamed``), in the order of
  the writes around it, so a crash at any point leaves the table before or after a change,
  never a mix. A change refused (its check, or no room for its record) changes nothing.
- A user blob's dirty files are named by its id (``u:<id>``, ``u:<id>.<part>``): a rename
  or an exchange is one table update, never a copy; an id is never handed out twice.
- An unlinked (or replaced) user blob's dirty blobs leave the table at once; their files
  are deleted after the next checkpoint saved a state without it (``DirtyTable.doomed``):
  before that a mount finds them, and a replay of the record drops them again.
- Every call is one change of its tag (``one_change``).
"""

from __future__ import annotations

import errno
import time

from faultfs.core.names import HIDDEN_PREFIX, PAGE_PREFIX, PAGEMAP_NAME, check_name, is_hidden
from faultfs.engine.changes import TagChanges, one_change
from faultfs.engine.tags import Tag
from faultfs.engine.writes.blobwrite import append
from faultfs.engine.writes.state import DEFAULT_MODE, TagStates
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import NEW, DirtyBlob, DirtyTable, chunk_index, part_name
from faultfs.errors import FaultfsError
from faultfs.store.journal import (
    KIND_CREATE,
    KIND_RENAME,
    KIND_UNLINK,
    RENAME_EXCHANGE,
    RENAME_REPLACE,
    Journal,
)
from faultfs.store.writestate import MODE_BITS

MODE_SET = 1 << 16  # in a create record's length: the mode bits below it are the blob's


class UserBlobs:
    """The user blob tables of an engine's tags; see the module docstring for the rules."""

    def __init__(self, table: DirtyTable, states: TagStates, sync: GroupCommit,
                 journal: Journal, changes: TagChanges) -> None:
        self.table = table
        self.states = states
        self.sync = sync
        self.journal = journal
        self.changes = changes  # (``one_change``)

    def check_name(self, tag: Tag, name: str) -> None:
        """A user blob may not take the name of anything the tag shows already, nor one the
        mount keeps for itself (``.pagemap``, ``.faultfs…``); other dotfiles are the user's."""
        check_name(name, "blob name", allow_dot=True)
        if (name == tag.view_name or name == PAGEMAP_NAME or name.startswith(PAGE_PREFIX)
                or is_hidden(name) or chunk_index(tag, name) is not None):
            raise FaultfsError(f"{name} names an entry of tag {tag.name}", errno.EPERM)

    @one_change
    async def create(self, tag: Tag, name: str, mode: int = DEFAULT_MODE) -> None:
        """Make user blob ``name``, empty, with permission bits ``mode`` (kept in its create
        record's length: a record of a faultfs before modes has 0 there, read as 0644)."""
        self.states.check_writable(tag)
        self.check_name(tag, name)
        tw = self.states.of(tag)
        if name in tw.users:
            raise FaultfsError(f"blob {name} of tag {tag.name} exists", errno.EEXIST)
        uid = tw.next_user
        mode &= MODE_BITS
        append(self.journal, KIND_CREATE, tag.name, name, uid, mode | MODE_SET)
        self.made(tag, name, uid, mode | MODE_SET)
        await self.sync.sync()

    @one_change
    async def set_attrs(self, tag: Tag, name: str, mode: int | None, atime_ns: int | None,
                        mtime_ns: int | None) -> None:
        """``chmod`` and ``utimensat`` of user blob ``name`` (None: unchanged), durable once
        answered: saved in its tag's write state (version 2), or nothing changes."""
        self.states.check_writable(tag)
        uid = self.states.user_uid(tag, name)
        tw = self.states.of(tag)
        before = tw.user_attrs.get(uid)
        attrs = list(self.states.user_attrs(tag, uid)[:3])  # (not the change time)
        for i, value in enumerate((mode, atime_ns, mtime_ns)):
            if value is not None:
                attrs[i] = value & MODE_BITS if i == 0 else value
        tw.user_attrs[uid] = attrs
        self.states.attrs_changed(tag)
        try:
            await self.states.save(tag.id)
        except BaseException:
            if tw.user_attrs.get(uid) is attrs:  # (put back: the change was not saved)
                if before is None:
                    del tw.user_attrs[uid]
                else:
                    tw.user_attrs[uid] = before
            raise

    @one_change
    async def unlink(self, tag: Tag, name: str) -> None:
        self.states.check_writable(tag)
        uid = self.states.of(tag).users.get(name)
        if uid is None:
            raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
        append(self.journal, KIND_UNLINK, tag.name, name, uid, 0)
        self.unlinked(tag, name, uid)
        await self.sync.sync()

    @one_change
    async def rename(self, tag: Tag, old: str, new: str, *, replace: bool = True) -> None:
        """Rename a user blob (replacing a user blob named ``new``; with ``replace`` False,
        EEXIST when there is one): one table update."""
        self.states.check_writable(tag)
        self.check_name(tag, new)
        users = self.states.of(tag).users
        if old not in users:
            raise FaultfsError(f"tag {tag.name} has no blob {old}", errno.ENOENT)
        if not replace and new in users:
            raise FaultfsError(f"blob {new} of tag {tag.name} exists", errno.EEXIST)
        append(self.journal, KIND_RENAME, tag.name, f"{old}\0{new}", RENAME_REPLACE, 0)
        self.renamed(tag, old, new, RENAME_REPLACE)
        await self.sync.sync()

    @one_change
    async def hide(self, tag: Tag, name: str, uid: int) -> str:
        """Unlink user blob ``name`` while a file still has it open: it is renamed to a name
        the mount keeps for itself (never listed nor found; ``hidden_name``), one record, and
        reads and writes by its id go on until the last close unlinks it (``unlink``). A
        mount drops whatever is left so after a crash (``drop_hidden``). The hidden name;
        ENOENT when ``name`` is not user blob ``uid`` (any more)."""
        self.states.check_writable(tag)
        if self.states.user_uid(tag, name) != uid:
            raise FaultfsError(f"blob {name} of tag {tag.name} was replaced", errno.ENOENT)
        hidden = hidden_name(uid)
        append(self.journal, KIND_RENAME, tag.name, f"{name}\0{hidden}", RENAME_REPLACE, 0)
        self.renamed(tag, name, hidden, RENAME_REPLACE)
        await self.sync.sync()
        return hidden

    def drop_hidden(self, tag: Tag) -> bool:
        """After a replay: the user blobs unlinked while open that a crash left (their last
        close never came) go, as an unlink would make them go; whether any did."""
        users = self.states.of(tag).users
        hidden = [(n, uid) for n, uid in users.items() if is_hidden(n)]
        for name, uid in hidden:
            self.unlinked(tag, name, uid)
        return bool(hidden)

    @one_change
    async def exchange(self, tag: Tag, a: str, b: str) -> None:
        """Swap two user blobs' names (renameat2's RENAME_EXCHANGE): one record, so the swap
        survives a crash whole or not at all. ENOENT unless both exist; nothing is dropped."""
        self.states.check_writable(tag)
        users = self.states.of(tag).users
        for name in (a, b):
            if name not in users:
                raise FaultfsError(f"tag {tag.name} has no blob {name}", errno.ENOENT)
        append(self.journal, KIND_RENAME, tag.name, f"{a}\0{b}", RENAME_EXCHANGE, 0)
        self.renamed(tag, a, b, RENAME_EXCHANGE)
        await self.sync.sync()

    # -- the changes, made live and at a replay ----------------------------------------------

    def made(self, tag: Tag, name: str, uid: int, mode: int = 0) -> None:
        """User blob ``name`` is made, empty, with id ``uid`` (``mode``: its create
        record's length, ``MODE_SET`` and the bits; 0 from a record made before modes)."""
        tw = self.states.of(tag)
        now = time.time_ns()
        tw.user_attrs[uid] = [mode & MODE_BITS if mode & MODE_SET else DEFAULT_MODE, now, now]
        tw.users[name] = uid
        tw.parted.add(uid)
        tw.next_user = max(tw.next_user, uid + 1)
        if (tag.id, part_name(uid, 0)) not in self.table.blobs:
            self.table.add(DirtyBlob(tag, part_name(uid, 0), None, 0, NEW))
        self.table.mark_changed(tag.id)

    def unlinked(self, tag: Tag, name: str, uid: int) -> None:
        """User blob ``name`` (id ``uid``) is gone."""
        tw = self.states.of(tag)
        if tw.users.get(name) != uid:
            return  # (a replay of a record the state includes already)
        del tw.users[name]
        tw.parted.discard(uid)
        tw.user_attrs.pop(uid, None)
        self._drop(tag, uid)

    def renamed(self, tag: Tag, old: str, new: str, how: int) -> None:
        """User blob ``old`` is named ``new`` (a blob named so before is gone), or the two
        swap names (``how``: RENAME_EXCHANGE)."""
        users = self.states.of(tag).users
        if old not in users or (how == RENAME_EXCHANGE and new not in users):
            return  # (a replay of a record the state includes already)
        if how == RENAME_EXCHANGE:
            users[old], users[new] = users[new], users[old]
            return
        replaced = users.pop(new, None)
        users[new] = users.pop(old)
        if replaced is not None:
            self.states.of(tag).parted.discard(replaced)
            self.states.of(tag).user_attrs.pop(replaced, None)
            self._drop(tag, replaced)

    def _drop(self, tag: Tag, uid: int) -> None:
        """Forget the dirty blobs of user blob ``uid``; their files go after the next
        checkpoint (and the first part's name in any case: an empty blob folded before any
        record was appended names seq 0, which a mount does not load)."""
        names = {self.table.forget((tag.id, b.name)).name
                 for b in list(self.table.parts(tag, uid).values())}
        damaged = self.states.of(tag).damaged_blobs
        for name in names:  # gone: nothing damaged is kept of it (its kept records stay)
            damaged.pop(name, None)
        names.add(part_name(uid, 0))
        self.table.doomed.extend((tag.name, name) for name in sorted(names))


def hidden_name(uid: int) -> str:
    """The name an unlinked user blob that is still open goes by (``UserBlobs.hide``)."""
    return f"{HIDDEN_PREFIX}-unlinked.{uid}"
