"""Recovery: what the store remembers of a tag's writes brought back at mount (its write state
and dirty files), the journal replayed over them, and the bases and direct files sorted out.

Invariants:
- After any crash each blob is the result of a prefix of its acknowledged writes that
  includes every write before the last completed ``fsync``: the journal replays in order and
  stops at the first record that does not verify (a whole-chunk record whose direct file does
  not verify counts as one); a dirty file names the last record it includes.
- One rule says whether a record (or a dirty file) is void — its tag is not mounted, a reset
  marked it, its user blob was unlinked, or its blob's dirty file includes it already (a
  change of the tag's table — a view size, a user blob made, renamed or unlinked, a reset —
  when the tag's write state does): ``void``. What is void is never applied, and its direct
  file is not needed; a void dirty file goes after the next checkpoint.
- A change of a tag's table is made by the room that makes it live (``UserBlobs``,
  ``Resets``), in the journal's order: a replay cannot make it otherwise.
- A replay that stops early keeps what follows (``journal.py``); a damaged blob's records are
  kept with their segments, never applied.
- A source that changed before a written chunk's base was staged leaves that blob damaged
  (saved before the tag's new source version is recorded), never its writes laid over the
  new version.
- A direct file is deleted only once no record that names it can be replayed: one no blob
  uses goes at once when it lies past the journal's end, else after the next checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import NamedTuple

from faultfs.core.extents import Ref
from faultfs.engine.tags import Tag
from faultfs.engine.writes.base import CleanReads, lost_why
from faultfs.engine.writes.checkpoint import Checkpoints
from faultfs.engine.writes.damage import Damage
from faultfs.engine.writes.reset import Resets
from faultfs.engine.writes.state import TagStates, TagWrites
from faultfs.engine.writes.sync import GroupCommit
from faultfs.engine.writes.table import (
    CLEAN,
    DIRECT,
    FOLDED,
    SPILL_RECORD,
    USER_PREFIX,
    VIEW,
    DirtyBlob,
    DirtyTable,
    chunk_index,
    user_key,
    void_key,
)
from faultfs.engine.writes.users import UserBlobs
from faultfs.errors import CorruptionError
from faultfs.store.blobfile import BlobHeader
from faultfs.store.dirty import DirtyFiles, folded_seq
from faultfs.store.journal import (
    KIND_BLOB,
    KIND_CREATE,
    KIND_RENAME,
    KIND_RESET,
    KIND_SIZE,
    KIND_UNLINK,
    KIND_WRITE,
    KIND_ZERO,
    TABLE_KINDS,
    Journal,
    Record,
)

log = logging.getLogger("faultfs.writes")
DAMAGED_SEQ = 1 << 62  # a damaged blob's file "includes" every record: none is applied to it


class TagLoad(NamedTuple):
    """A tag's writes as the store has them (``Recovery.load_tag``): its write state, why
    that state is damaged (None: it is not), the headers of its damaged blobs' older files,
    and each dirty file's name with its header, or why it is damaged."""

    writes: TagWrites
    state_error: str | None
    older: dict[str, BlobHeader | None]
    files: list[tuple[str, BlobHeader | None, str | None]]


class Recovery:
    """Opening tags' writes and replaying the journal (blocking, before the mount answers)."""

    def __init__(self, table: DirtyTable, states: TagStates, damage: Damage,
                 sync: GroupCommit, checkpoints: Checkpoints, clean: CleanReads,
                 files: DirtyFiles, journal: Journal, users: UserBlobs,
                 resets: Resets) -> None:
        self.users = users
        self.resets = resets
        self.table = table
        self.states = states
        self.damage = damage
        self.sync = sync
        self.checkpoints = checkpoints
        self.clean = clean
        self.files = files
        self.journal = journal

    def load_tag(self, tag: Tag) -> TagLoad:
        """What the store has of ``tag``'s writes, read (blocking, on the pool when the
        mount serves): its write state and its dirty files' headers. Nothing shared changes
        here: ``open_tag`` applies it, on the thread that owns the table."""
        state_error = None
        try:
            doc = self.files.read_state(tag.name)
            try:
                tw = TagWrites.parse(doc, tag.layout.size)
            except CorruptionError as exc:  # as fsck says it (``store/writestate.py``)
                raise CorruptionError(f"write state of {tag.name}: {exc.message}") from None
        except CorruptionError as exc:
            state_error = exc.message
            tw = TagWrites(view_size=tag.layout.size, damaged=exc.message)
        ids = set(tw.users.values())
        older: dict[str, BlobHeader | None] = {}
        for name in tw.damaged_blobs:
            if not _unlinked(tw, name, ids):
                try:  # its older file (kept, unused) still names a seq
                    older[name] = self.files.header(tag.name, name, tw.ancestors)
                except CorruptionError:
                    older[name] = None
        files: list[tuple[str, BlobHeader | None, str | None]] = []
        for name in self.files.names(tag.name):
            if name in tw.damaged_blobs:
                continue
            try:
                files.append((name, self.files.header(tag.name, name, tw.ancestors), None))
            except CorruptionError as exc:
                files.append((name, None, exc.message))
        return TagLoad(tw, state_error, older, files)

    def open_tag(self, tag: Tag, loaded: TagLoad | None = None) -> None:
        """Bring back what the store remembers of ``tag``'s writes (dirty files, state), as
        ``load_tag`` read it (read now when not given). A damaged write state is kept and
        reported: the tag's dirty files still read, but the tag takes no writes (they would
        replace the state) until ``faultfs fsck`` is run."""
        tw, state_error, older, files = loaded if loaded is not None else self.load_tag(tag)
        if state_error is not None:
            log.error("tag %s: %s: kept; the tag's writes read, new writes are refused",
                      tag.name, state_error)
        self.states.tags[tag.id] = tw
        self.states.names[tag.id] = tag.name
        # seqs the state names (a reset's void marks, the view's size) are never handed out
        # again, also when a power loss took the journal's records up to them
        self.journal.advance(max(tw.voided, tw.view_seq, *tw.voided_blobs.values()))
        if tw.view_size != tag.layout.size or tw.users:
            self.table.mark_changed(tag.id)
        ids = set(tw.users.values())
        for name, mark in list(tw.damaged_blobs.items()):
            if _unlinked(tw, name, ids):
                del tw.damaged_blobs[name]  # unlinked since: nothing to keep
                continue
            log.error("tag %s: dirty blob %s is damaged (%s): kept, reads of it fail with EIO "
                      "until faultfs reset drops its writes", tag.name, name, mark["reason"])
            header = older.get(name)
            if header is not None:  # never handed out again
                self.journal.advance(folded_seq(header))
            self.table.add(DirtyBlob(tag, name, chunk_index(tag, name), mark["size"], FOLDED,
                                     DAMAGED_SEQ, folded_size=mark["size"],
                                     damaged=mark["reason"]))
        for name, header, damage in files:
            if damage is not None:
                log.error("tag %s: %s: kept, reads of it fail with EIO", tag.name, damage)
                index = chunk_index(tag, name)
                size = tag.layout.chunk_size if index is not None else 0
                self.table.add(DirtyBlob(tag, name, index, size, FOLDED, DAMAGED_SEQ,
                                         folded_size=size, damaged=damage))
                continue
            assert header is not None
            seq = folded_seq(header)
            if self.void(tag, name, seq, ids=ids):
                if self.states.writable:  # reset, or unlinked: it goes after a checkpoint
                    self.table.doomed.append((tag.name, name))
                continue
            self.journal.advance(seq)
            self.table.add(DirtyBlob(tag, name, chunk_index(tag, name), header.payload_len,
                                     FOLDED, seq, folded_size=header.payload_len))

    def void(self, tag: Tag | None, name: str, seq: int, kind: int = KIND_WRITE, *,
             ids: Collection[int] | None = None) -> bool:
        """Whether a change of blob ``name`` of ``tag`` at ``seq`` (a journal record of
        ``kind``, or a dirty file naming that seq) is void — nothing of it is applied: its tag
        is not mounted, a reset marked it, its user blob was unlinked, or the blob's dirty
        file includes it (a view size record: the write state does). No side effects."""
        if tag is None or tag.id not in self.states.tags:
            return True
        tw = self.states.tags[tag.id]
        if seq <= tw.voided:
            return True
        if kind in TABLE_KINDS or (kind == KIND_SIZE and name == VIEW):
            return seq <= tw.view_seq
        if seq <= tw.voided_blobs.get(void_key(name), 0) or _unlinked(tw, name, ids):
            return True
        blob = self.table.blobs.get((tag.id, name))
        return blob is not None and seq <= blob.folded_seq

    def replay(self, tags: dict[str, Tag]) -> int:
        """Apply the journal's records after each blob's dirty file; the records applied.
        A whole-chunk record whose direct file does not verify (a power loss before it was
        synced) ends the replay there, like a torn record."""
        applied = 0
        first: int | None = None

        def accept(rec: Record) -> bool:
            """A whole-chunk record that will be applied needs its file, whole."""
            if rec.kind != KIND_BLOB:
                return True
            tag = tags.get(rec.tag)
            if tag is None or chunk_index(tag, rec.name) is None or self.void(tag, rec.name,
                                                                              rec.seq):
                return True  # not applied: whether its file is there does not matter
            return self.files.check_direct(tag.name, rec.name, rec.seq, rec.length, rec.digest)

        def set_aside(blobs: list[tuple[str, int]]) -> None:
            """The whole-chunk records the replay keeps aside: their files go with them (no
            record on disk names them now; a live blob's file stays)."""
            used = self._used_direct()
            for tag_name, seq in blobs:
                if tag_name in tags and (tag_name, seq) not in used:
                    self.files.set_aside_direct(tag_name, seq, self.journal.damaged_dir)

        def unused(rec: Record) -> bool:
            """A write whose data does not verify may be passed over when nothing would use
            it: its blob is known damaged, reset since, or gone."""
            return (self.damage.blob_of(tags, rec) is not None
                    or self.void(tags.get(rec.tag), rec.name, rec.seq, rec.kind))

        for rec in self.journal.replay(writable=self.states.writable, accept=accept,
                                       set_aside=set_aside, damaged=unused):
            first = rec.seq if first is None else first
            kept = self.damage.blob_of(tags, rec)
            if kept is not None:  # a damaged blob's record: kept with its segment, not used
                self.damage.keep_segments.add(rec.segment)
                if rec.kind == KIND_BLOB and self.states.writable:  # and its file, with them
                    self.files.set_aside_direct(kept.tag.name, rec.seq,
                                                self.journal.damaged_dir)
                continue
            if rec.bad_data:
                continue  # void (``unused``): nothing reads it
            tag = tags.get(rec.tag)
            if self.void(tag, rec.name, rec.seq, rec.kind):
                continue
            assert tag is not None
            if rec.kind == KIND_SIZE and rec.name == VIEW:
                self.states.set_view_size(tag, self.states.tags[tag.id], rec.length)
                applied += 1
                continue
            if rec.kind in TABLE_KINDS:
                self._table_change(tag, rec)
                applied += 1
                continue
            if rec.kind == KIND_BLOB and chunk_index(tag, rec.name) is None:
                continue  # only chunks are written so; never a record of ours otherwise
            blob = self.table.blob_for(tag, rec.name, self.states.tags[tag.id].users.values())
            if blob is None:
                continue
            self._apply(blob, rec)
            applied += 1
        self.checkpoints.kept_from = self.journal.next_seq if first is None else first
        aside = self.journal.set_aside
        if aside is not None:
            log.error("the write journal does not verify at byte %d of %s (%s): the %d "
                      "records after it that verify were not replayed; they are kept in %s "
                      "(faultfs fsck lists them)", aside.pos, aside.segment, aside.reason,
                      aside.records, self.journal.damaged_dir)
        if self.states.writable:
            for tag in tags.values():
                if tag.id in self.states.tags and self.users.drop_hidden(tag):
                    self.states.unsaved.add(tag.id)  # saved without them before files go
        self._sort_direct_files(tags)
        return applied

    def _table_change(self, tag: Tag, rec: Record) -> None:
        """A record of ``tag``'s table made as it was made live."""
        if rec.kind == KIND_CREATE:
            self.users.made(tag, rec.name, rec.off)
        elif rec.kind == KIND_UNLINK:
            self.users.unlinked(tag, rec.name, rec.off)
        elif rec.kind == KIND_RENAME:
            old, _, new = rec.name.partition("\0")
            self.users.renamed(tag, old, new, rec.off)
        else:
            assert rec.kind == KIND_RESET
            names = bytes(rec.data).decode("utf-8").split("\0") if rec.length else None
            self.resets.made(tag, names, rec.seq, rec.off)

    def _apply(self, blob: DirtyBlob, rec: Record) -> None:
        table = self.table
        table.user_changed(blob)
        table.touch(blob)
        if rec.kind == KIND_BLOB:  # its file verified (``replay``): the blob is that file
            table.set_direct(blob, rec.seq)
            # after a kill -9 it may be in the page cache only: the next sync (an fsync, the
            # checkpoint before it is renamed) must make it durable like one written now
            self.sync.unsynced.append((blob.tag.name, rec.seq))
        elif rec.kind == KIND_WRITE:  # read back from the journal when it is read
            table.write(blob, rec.off, rec.data if rec.length > SPILL_RECORD else Ref(
                rec.segment, rec.data_pos, rec.length, rec.data_digest, 0, rec.length, None))
        elif rec.kind == KIND_ZERO:
            table.zero(blob, rec.off, rec.length)
        else:  # KIND_SIZE of a user blob
            table.resize(blob, rec.length)

    def _used_direct(self) -> set[tuple[str, int]]:
        return {(b.tag.name, b.direct) for b in self.table if b.base is DIRECT}

    def _sort_direct_files(self, tags: dict[str, Tag]) -> None:
        """After a replay: direct files no blob uses are deleted — at once when no record on
        disk can name them (past the journal's end), else after the next checkpoint trims
        the journal (a replay before then would look for them)."""
        if not self.states.writable:
            return
        used = self._used_direct()
        for tag in tags.values():
            if tag.id not in self.states.tags:
                continue
            for seq in self.files.direct_seqs(tag.name):
                if (tag.name, seq) in used:
                    continue
                if seq >= self.journal.next_seq:
                    self.files.delete_direct(tag.name, seq)
                else:
                    self.table.obsolete.append((tag.name, seq))

    def check_bases(self) -> None:
        """After the replay (blocking, before the tags' new source versions are recorded): a
        chunk whose replayed writes lie over the source's bytes of the last mount, when the
        source changed since, is damaged (kept, EIO; saved now) — never its writes laid over
        the new version. The staged bases of the others are pinned again."""
        hit: set[int] = set()
        for blob in list(self.table):
            if blob.base is not CLEAN or blob.index is None or blob.damaged:
                continue
            tag = blob.tag
            why = lost_why(blob, f"{tag.name}'s source is not the version of the last "
                                 "mount" if tag.source_changed else "")
            if why:
                self.damage.note(blob, why)
                hit.add(tag.id)
            else:
                self.clean.pin(tag, blob.index)
        for tag_id in sorted(hit):
            try:
                self.states.write_now(tag_id)
            except OSError as exc:  # the next checkpoint saves it again
                log.error("keeping the damaged blobs of tag %s: %s", self.states.names[tag_id],
                          exc.strerror)

    def needs_checkpoint(self) -> bool:
        """Whether the writes found at mount should be folded now (a replay left some)."""
        table = self.table
        return bool(table.held or table.direct_count or table.obsolete or table.doomed
                    or any(b.pending for b in table))


def _unlinked(tw: TagWrites, name: str, ids: Collection[int] | None = None) -> bool:
    """Whether ``name`` is a user blob's dirty blob whose user blob is gone (``ids``: the
    tag's user blob ids, when the caller has them at hand)."""
    if not name.startswith(USER_PREFIX):
        return False
    user = user_key(name)
    return user is None or user[0] not in (tw.users.values() if ids is None else ids)
