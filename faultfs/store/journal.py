"""The write journal: every write to a dirty blob, appended as one checksummed record before the
write is acknowledged, so a crash loses nothing acknowledged and tears nothing (DESIGN §11).

Layout: ``<store>/writes/journal/w-<first seq, 16 hex>.log`` segments, replayed in order.
A record (little-endian), pinned by a golden-bytes test — change it and bump ``MAGIC``:

    0   magic       8  b"FFSWAL\\x00\\x01" (kinds 1-3), b"FFSWAL\\x00\\x02" (kind 4),
                       b"FFSWAL\\x00\\x03" (kinds 5-8)
    8   seq         u64  1, 2, 3 ... across segments, never reused
    16  kind        u8   1 write (data follows), 2 zero (a range reads as zeros), 3 size,
                         4 blob (the whole blob is the dirty file ``d-<seq>`` of its tag),
                         5 create (user blob ``name`` made, id ``off``), 6 unlink (user
                         blob ``name``, id ``off``), 7 rename (``name`` is old NUL new; off
                         0 replaces a blob named new, 2 exchanges the two), 8 reset (the
                         names NUL-separated are the data, none: the whole tag; off: the
                         tag's mtime after it)
    17  reserved    u8   0
    18  tag_len     u16
    20  name_len    u16  (0 with kind 3: the size of the tag's whole-object view)
    22  reserved    u16  0
    24  off         u64  write/zero: offset in the blob; size: 0
    32  length      u64  write, reset: data bytes; zero: range length; size: the new size;
                         blob: the payload bytes of its file; create: 0x10000 | its
                         mode bits (0 in records made before modes: 0644); unlink/rename: 0
    40  data_xxh3   u64  xxh3_64 of the data (0 without data); blob: of the file's payload
    48  head_xxh3   u64  xxh3_64 of bytes [0, 48) + tag + name
    56  tag, name (UTF-8), then the data

Version 2 added kind 4 and nothing else: a record of kinds 1-3 is the same bytes in both
versions (it keeps the version-1 magic, so a version-1 journal is read as it always was); a
kind-4 record carries the version-2 magic, so a faultfs that knows only version 1 stops its
replay there, as at any record it cannot verify. Version 3 added kinds 5-8 the same way: the
changes of a tag's table (user blobs made, unlinked, renamed; resets) are records replayed
in order with the writes, where they were saved in the tag's write state outside the
journal's order before.

Invariants:
- A record is acknowledged once ``append`` returned: its bytes are in the kernel (a kill -9 of
  the daemon keeps them). ``sync`` makes every record appended before it durable.
- Replay yields records in seq order and stops at the first record that does not verify
  (torn, truncated, foreign): what follows it is not trusted, so a crash leaves a prefix.
  What follows the stop is cut off when it is a crash's torn tail (no whole, verifying run
  of records after it); when records that verify follow (damage in the middle, or a power
  loss that lost a middle page), they are moved or copied to ``writes/damaged/``, never
  deleted, and their seqs are never handed out again (an empty segment names the next).
- ``sync`` fsyncs older segments before the current one: a durable record in a later
  segment never follows a lost one that a sync vouched for (replay stops at the first
  record that does not verify, wherever it is).
- ``trim(seq)`` deletes the segments whose records all have a seq at or below it (they are
  folded into blob files); the current segment is never deleted while it is written.
- ``read_data`` reads a write record's data back (a spilled extent of a dirty blob) only from
  a segment that is still there, and only bytes that verify against the record's checksum.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import xxhash

from faultfs.errors import CorruptionError, FaultfsError, StoreFull
from faultfs.store.fileops import FileOps, OsFileOps, free_name, kept_dir

MAGIC = b"FFSWAL\x00\x01"
MAGIC_V2 = b"FFSWAL\x00\x02"  # kind 4 (KIND_BLOB) only: see the module docstring
MAGIC_V3 = b"FFSWAL\x00\x03"  # kinds 5-8, a tag's table: see the module docstring
MAGIC_PREFIX = MAGIC[:7]  # what both versions' records begin with
KIND_WRITE, KIND_ZERO, KIND_SIZE, KIND_BLOB = 1, 2, 3, 4
KIND_CREATE, KIND_UNLINK, KIND_RENAME, KIND_RESET = 5, 6, 7, 8
TABLE_KINDS = (KIND_CREATE, KIND_UNLINK, KIND_RENAME, KIND_RESET)  # a tag's table, not a blob
DATA_KINDS = (KIND_WRITE, KIND_RESET)  # records whose data follows them
RENAME_REPLACE, RENAME_EXCHANGE = 0, 2  # a rename record's off
KNOWN = {MAGIC: (KIND_WRITE, KIND_ZERO, KIND_SIZE), MAGIC_V2: (KIND_BLOB,), MAGIC_V3: TABLE_KINDS}
_HEAD = struct.Struct("<8sQBBHHHQQQ")
_CHECK = struct.Struct("<Q")
DATA_DIGEST_AT = 40  # where a record's data_xxh3 lies in its head
HEAD_LEN = _HEAD.size + 8  # the fixed part and its checksum: 56 bytes
assert HEAD_LEN == 56
SEGMENT_BYTES = 64 << 20  # a segment is closed (fsynced) and a new one started past this
MAX_RECORD_DATA = 1 << 30  # a write record carries at most one blob's bytes
MAX_SEQ = 1 << 62  # no journal gets near it; a record claiming more is not one of ours
DAMAGED_DIR = "damaged"  # writes/damaged/: what a replay could not trust, kept, never read
SCAN_STEP = 4 << 20  # what is set aside is scanned for record heads in pieces of this much
SEGMENT_PREFIX, SEGMENT_SUFFIX = "w-", ".log"
INLINE_DATA = 64 << 10  # data up to this is joined to its record's head: one pwrite


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    kind: int
    tag: str
    name: str
    off: int
    length: int
    data: bytes | memoryview = b""
    digest: int = 0  # KIND_BLOB: xxh3_64 of its file's payload (0 for the other kinds)
    # where a replayed KIND_WRITE record's data lies (``read_data``), and its checksum
    segment: int = 0
    data_pos: int = 0
    data_digest: int = 0
    bad_data: bool = False  # its head verifies, its data does not (given out as b"")


@dataclass
class SetAside:
    """What a replay set aside in ``writes/damaged/`` instead of deleting it: everything from
    a record that does not verify on, when whole runs of records that verify follow it."""

    segment: str  # the segment and byte where the replay stopped, and why
    pos: int
    reason: str
    files: list[str]  # what was kept, in writes/damaged/
    records: int  # verifying records found in what was kept
    blobs: list[tuple[str, int]]  # (tag, seq) of the whole-chunk records among them


class SegmentGone(FaultfsError):
    """A record's segment was trimmed: its writes are folded into a file now (read that)."""


def encode_prefix(rec: Record) -> bytes:
    """A record without its data: the fixed part, its checksum, the tag and the name (an
    append writes the data after it, uncopied)."""
    return _prefix(rec.seq, rec.kind, rec.tag, rec.name, rec.off, rec.length, rec.data,
                   rec.digest)


def _prefix(seq: int, kind: int, tag: str, name: str, off: int, length: int,
            data: bytes | memoryview, digest: int) -> bytes:
    names = (tag + name).encode("utf-8")
    tag_len = len(tag.encode("utf-8")) if not tag.isascii() else len(tag)
    magic = MAGIC_V3 if kind in TABLE_KINDS else MAGIC_V2 if kind == KIND_BLOB else MAGIC
    if kind in DATA_KINDS:
        if len(data) != length:
            raise ValueError("a record's length is its data's")
        digest = xxhash.xxh3_64_intdigest(data) if length else 0
    elif kind != KIND_BLOB:
        digest = 0
    head = _HEAD.pack(magic, seq, kind, 0, tag_len, len(names) - tag_len, 0, off, length, digest)
    return head + _CHECK.pack(xxhash.xxh3_64_intdigest(head + names)) + names


def encode(rec: Record) -> bytes:
    prefix = encode_prefix(rec)
    return prefix + rec.data if rec.kind in DATA_KINDS else prefix


def data_len(kind: int, length: int) -> int:
    """The bytes of data that follow a record of ``kind`` and ``length``."""
    return length if kind in DATA_KINDS else 0


def decode_head(raw: bytes) -> tuple[int, int, int, int, int, int, int, int]:
    """``(seq, kind, tag_len, name_len, off, length, data_xxh3, check)`` of a record's fixed
    part; CorruptionError when it is not one."""
    if len(raw) < HEAD_LEN:
        raise CorruptionError("journal record truncated")
    magic, seq, kind, r1, tag_len, name_len, r2, off, length, digest = _HEAD.unpack_from(raw)
    if kind not in KNOWN.get(magic, ()) or r1 or r2:
        raise CorruptionError("not a journal record")
    if kind in DATA_KINDS and length > MAX_RECORD_DATA:
        raise CorruptionError("journal record too long")
    if not 0 < seq <= MAX_SEQ:
        raise CorruptionError(f"journal record seq {seq} is out of range")
    (check,) = struct.unpack_from("<Q", raw, _HEAD.size)
    return seq, kind, tag_len, name_len, off, length, digest, check


def segment_name(first_seq: int) -> str:
    return f"{SEGMENT_PREFIX}{first_seq:016x}{SEGMENT_SUFFIX}"


def _segment_seq(name: str) -> int | None:
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)]
    try:
        return int(digits, 16) if len(digits) == 16 else None
    except ValueError:
        return None


class Journal:
    """The journal of one store. Blocking (file I/O); appends are small and ordered."""

    def __init__(self, directory: str, ops: FileOps | None = None) -> None:
        self.dir = directory
        self.ops = ops or OsFileOps(links=False, what="journal segment")
        self.next_seq = 1
        self._fd = -1
        self._first = 0  # first seq of the segment being written
        self._pos = 0  # where the next record goes in it
        self._segments: list[int] = []  # first seqs of the segments on disk, oldest first
        self._readers: dict[int, int] = {}  # segment -> descriptor data is read back through
        # (segment, data offset, data xxh3) of the last KIND_WRITE record appended
        self.last_data: tuple[int, int, int] = (0, 0, 0)
        self._dir_dirty = False  # a segment was created since the directory's last fsync
        self._unsynced: list[int] = []  # descriptors of older segments not fsynced yet
        self._lock = threading.Lock()  # appends and rolls on one thread, syncs on another
        self._sync_lock = threading.Lock()  # one sync at a time: a second waits, then syncs
        self.appended = 0  # bytes appended since open (stats)
        self.set_aside: SetAside | None = None  # what the replay kept in writes/damaged/

    # -- replay ------------------------------------------------------------------------------

    def replay(self, *, writable: bool = True,
               accept: Callable[[Record], bool] | None = None,
               set_aside: Callable[[list[tuple[str, int]]], None] | None = None,
               damaged: Callable[[Record], bool] | None = None) -> Iterator[Record]:
        """The records on disk, in order, up to the first one that does not verify. Leaves the
        journal ready to append after the last good record. ``writable=False`` (a store that
        cannot be written) only reads. ``accept``: asked about each record just before it is
        yielded (after the ones before it were used); False makes it count as one that does
        not verify (a KIND_BLOB record whose file was lost). ``damaged``: whether a write
        whose head verifies but whose data does not belongs to a blob already known damaged;
        then it is yielded (``bad_data``, no data) and the replay goes on.

        Where the replay stops, a crash's torn tail (nothing after it that verifies as a
        whole run of records) is cut off. When such runs follow (damage in the middle, or a
        power loss that kept later pages of an unsynced segment), everything from the stop is
        kept in ``writes/damaged/`` instead — ``set_aside`` is first told the ``(tag, seq)``
        of the whole-chunk records among it, so that their files can go there too — and
        ``set_aside`` (the attribute) says what was kept."""
        if writable:
            try:
                self.ops.makedirs(self.dir)
            except OSError as exc:  # a full store: its first append makes it, or fails
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
        firsts = sorted(s for s in (_segment_seq(n) for n in self.ops.listdir(self.dir))
                        if s is not None)
        good_end: tuple[int, int] | None = None  # (segment, offset) after the last good record
        stop: tuple[int, int, str] | None = None  # (segment, offset, why) where it stopped
        expect = 1  # records only go up; ``next_seq`` may be ahead already (``advance``)
        for first in firsts:
            expect = max(expect, first)  # an empty segment still names its seq
            self.next_seq = max(self.next_seq, first)
            path = os.path.join(self.dir, segment_name(first))
            fd = self.ops.open(path, os.O_RDONLY)
            try:
                size = self.ops.size(fd)
                pos = 0
                while pos < size:
                    rec, length, why = read_record(self.ops, fd, pos, size, first)
                    if rec is not None and rec.bad_data and (
                            damaged is None or not damaged(rec)):
                        why = "record data checksum mismatch"
                        rec = None
                    elif rec is not None and rec.seq < expect:
                        why = f"seq {rec.seq} after {expect - 1}"
                        rec = None
                    elif rec is not None and accept is not None and not accept(rec):
                        why = "its file is missing or does not verify"
                        rec = None
                    if rec is None:
                        stop = (first, pos, why)
                        break
                    expect = rec.seq + 1
                    self.next_seq = max(self.next_seq, expect)
                    pos += length
                    yield rec
            finally:
                self.ops.close(fd)
            good_end = (first, pos)
            if stop is not None:
                break
        self._segments = [s for s in firsts if good_end is not None and s <= good_end[0]]
        if not writable:
            return
        later = [s for s in firsts if s not in self._segments]
        found = [] if stop is None else self._found_after(stop, later, damaged)
        if stop is not None and found:
            self.set_aside = self._set_aside(stop, later, found, set_aside)
        else:
            for first in later:  # past a torn tail: nothing written after it was trusted
                self.ops.unlink(os.path.join(self.dir, segment_name(first)))
            if good_end is not None:
                first, pos = good_end
                self._fd = self.ops.open(os.path.join(self.dir, segment_name(first)), os.O_RDWR)
                self.ops.ftruncate(self._fd, pos)
                self._first, self._pos = first, pos
        # What a kill -9 left may be in the page cache only (the records, the segments'
        # names): the next sync makes all of it durable, as if appended in this mount.
        for first in self._segments:
            if first != self._first:
                self._unsynced.append(
                    self.ops.open(os.path.join(self.dir, segment_name(first)), os.O_RDONLY))
        self._dir_dirty = bool(self._segments)

    def _found_after(self, stop: tuple[int, int, str], later: list[int],
                     damaged: Callable[[Record], bool] | None) -> list[tuple[int, int, str]]:
        """``(seq, kind, tag)`` of every whole record that verifies after the stop (found by
        its magic, in the rest of its segment and in the later segments; a write of a blob
        ``damaged`` names counts too), led by the stopped record when its head verifies.
        None: a torn tail, cut off. Any: kept — keeping too much costs disk, cutting a
        record that verifies would lose it. Each is checked once and the scan goes on after
        it (linear in the bytes)."""
        first, pos, _ = stop
        stopped: list[tuple[int, int, str]] = []
        after: list[tuple[int, int, str]] = []
        for seg, start in [(first, pos + 1), *((s, 0) for s in later)]:
            fd = self.ops.open(os.path.join(self.dir, segment_name(seg)), os.O_RDONLY)
            try:
                size = self.ops.size(fd)
                if seg == first:
                    rec, _, _ = read_record(self.ops, fd, pos, size, seg)
                    if rec is not None:
                        stopped.append((rec.seq, rec.kind, rec.tag))
                resume = start
                for at in magic_positions(self.ops, fd, start, size):
                    if at < resume:
                        continue  # inside a record found whole
                    rec, length, _ = read_record(self.ops, fd, at, size, seg)
                    if rec is None or (rec.bad_data and (damaged is None or not damaged(rec))):
                        continue
                    after.append((rec.seq, rec.kind, rec.tag))
                    resume = at + length
            finally:
                self.ops.close(fd)
        return stopped + after if after else []

    def _set_aside(self, stop: tuple[int, int, str], later: list[int],
                   found: list[tuple[int, int, str]],
                   files: Callable[[list[tuple[str, int]]], None] | None) -> SetAside:
        """Keep what follows a record that does not verify in ``writes/damaged/``, crash by
        crash safe: first an empty segment names the next seq (so none that is kept is
        handed out again, whatever happens after), then ``files`` moves the direct files of
        the whole-chunk records among them, then the rest of the stopped segment is copied
        and later segments are moved (empty ones stay: one may be that mark), and last the
        stopped segment is cut. A crash on the way leaves the same stop for the next mount
        to keep again (copies get free names). The mark is the segment appended to."""
        first, pos, why = stop
        for seq, _, _ in found:
            if seq <= MAX_SEQ // 2:  # (a seq near the limit is not one this journal gave)
                self.next_seq = max(self.next_seq, seq + 1)
        for seg in later:
            self.next_seq = max(self.next_seq, seg + 1)
        self.next_seq = max(self.next_seq, first + 1)  # the mark comes after the stopped one
        empty = [s for s in later if self._size(s) == 0]
        mark = max(empty, default=0)
        if mark < self.next_seq:
            mark = self.next_seq
            while self.ops.exists(os.path.join(self.dir, segment_name(mark))):
                mark += 1  # (a foreign entry by that name: the next free seq)
            fd = self.ops.open(os.path.join(self.dir, segment_name(mark)),
                               os.O_RDWR | os.O_CREAT | os.O_EXCL)
            self.ops.fsync(fd)
            self.ops.close(fd)
            self.ops.fsync_dir(self.dir)
        self.next_seq = max(self.next_seq, mark)
        if files is not None:
            files([(tag, seq) for seq, kind, tag in found if kind == KIND_BLOB])
        dest = self._damaged_dir_ready()
        kept: list[str] = []
        src = self.ops.open(os.path.join(self.dir, segment_name(first)), os.O_RDWR)
        try:
            size = self.ops.size(src)
            name = free_name(self.ops, dest, f"{segment_name(first)}.from-{pos}")
            out = self.ops.open(os.path.join(dest, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                at = pos
                for piece in _pieces(self.ops, src, pos, size):
                    written = 0
                    while written < len(piece):
                        written += self.ops.pwrite(out, piece[written:], at - pos + written)
                    at += len(piece)
                self.ops.fsync(out)
            finally:
                self.ops.close(out)
            kept.append(name)
            for seg in later:
                if seg in empty:
                    continue
                name = free_name(self.ops, dest, segment_name(seg))
                self.ops.rename(os.path.join(self.dir, segment_name(seg)),
                                os.path.join(dest, name))
                kept.append(name)
            self.ops.fsync_dir(dest)
            self.ops.fsync_dir(self.dir)
            self.ops.ftruncate(src, pos)
            self.ops.fsync(src)
        finally:
            self.ops.close(src)
        self._segments = [*self._segments, *sorted({*empty, mark} - set(self._segments))]
        self._fd = self.ops.open(os.path.join(self.dir, segment_name(mark)), os.O_RDWR)
        self._first, self._pos = mark, 0
        return SetAside(segment_name(first), pos, why, kept, len(found),
                        [(tag, seq) for seq, kind, tag in found if kind == KIND_BLOB])

    def _size(self, segment: int) -> int:
        fd = self.ops.open(os.path.join(self.dir, segment_name(segment)), os.O_RDONLY)
        try:
            return self.ops.size(fd)
        finally:
            self.ops.close(fd)

    # -- appending ---------------------------------------------------------------------------

    def append(self, kind: int, tag: str, name: str, off: int, length: int,
               data: bytes | memoryview = b"", digest: int = 0) -> int:
        """Append one record; its seq (always ``next_seq`` as it was: a caller may name a
        file by it first). StoreFull (nothing appended) when there is no room. ``digest``:
        a KIND_BLOB record's payload checksum."""
        if self._fd < 0 or self._pos >= SEGMENT_BYTES:
            try:
                self._start_segment()
            except OSError as exc:
                raise _failure(exc) from None
        seq = self.next_seq
        prefix = _prefix(seq, kind, tag, name, off, length, data, digest)
        pos = self._pos
        data_at = pos + len(prefix)
        try:
            if kind not in DATA_KINDS or length <= INLINE_DATA:
                # one syscall: joining a few KiB costs less than a second one
                raw = prefix + data if kind in DATA_KINDS else prefix
                if self.ops.pwrite(self._fd, raw, pos) != len(raw):
                    self._write_all(raw, pos)
                pos += len(raw)
            else:  # a large write is never copied: two syscalls
                for part in (prefix, data):
                    self._write_all(part, pos)
                    pos += len(part)
        except OSError as exc:
            self.ops.ftruncate(self._fd, self._pos)  # no half record stays behind
            raise _failure(exc) from None
        self.appended += pos - self._pos
        self._pos = pos
        self.next_seq = seq + 1
        if kind == KIND_WRITE:
            self.last_data = (self._first, data_at, _CHECK.unpack_from(prefix, DATA_DIGEST_AT)[0])
        return seq

    # -- reading data back -------------------------------------------------------------------

    def read_data(self, segment: int, pos: int, length: int, digest: int) -> bytes:
        """The ``length`` bytes of a write record's data at ``pos`` of ``segment``, verified
        against its checksum ``digest`` (any thread). SegmentGone when the segment was
        trimmed (its writes are folded), CorruptionError when the bytes do not verify."""
        with self._lock:
            if segment not in self._segments:
                raise SegmentGone(f"journal segment {segment} was trimmed")
            fd = self._readers.get(segment)
            if fd is None:
                try:
                    fd = self._readers[segment] = self.ops.open(
                        os.path.join(self.dir, segment_name(segment)), os.O_RDONLY)
                except FileNotFoundError:
                    raise SegmentGone(f"journal segment {segment} was trimmed") from None
            data = self.ops.pread(fd, length, pos)
        if len(data) != length or xxhash.xxh3_64_intdigest(data) != digest:
            raise CorruptionError(f"journal segment {segment_name(segment)}: the data at "
                                  f"{pos} does not verify")
        return data

    def _write_all(self, part: bytes | memoryview, pos: int) -> None:
        view = memoryview(part)
        written = 0
        while written < len(view):
            written += self.ops.pwrite(self._fd, view[written:], pos + written)

    def _start_segment(self) -> None:
        """Start the next segment (on the thread that appends). The one before is fsynced by
        the next ``sync`` before anything else, so a sync never leaves a hole behind it."""
        self.ops.makedirs(self.dir)
        first = self.next_seq
        fd = self.ops.open(os.path.join(self.dir, segment_name(first)),
                           os.O_RDWR | os.O_CREAT | os.O_EXCL)
        with self._lock:
            if self._fd >= 0:
                self._unsynced.append(self._fd)
            self._fd, self._first, self._pos = fd, first, 0
            self._segments.append(first)
            self._dir_dirty = True

    def sync(self) -> None:
        """Make every record appended so far durable (may run on another thread than the
        appends: older segments first, then the current one, then the directory). Syncs
        are serialised: one that returns covers every append before it was called, even
        while another sync (a checkpoint's) is under way."""
        with self._sync_lock:
            self._sync()

    def _sync(self) -> None:
        with self._lock:
            old, current, dir_dirty = list(self._unsynced), self._fd, self._dir_dirty
            self._dir_dirty = False
        try:
            for fd in old:
                self.ops.fsync(fd)
            if current >= 0:
                self.ops.fsync(current)
            if dir_dirty:
                self.ops.fsync_dir(self.dir)
        except OSError as exc:
            with self._lock:
                self._dir_dirty = self._dir_dirty or dir_dirty
            raise _failure(exc) from None
        with self._lock:
            for fd in old:
                self._unsynced.remove(fd)
                self.ops.close(fd)

    def advance(self, seq: int) -> None:
        """Never hand out ``seq`` or anything below it (a folded blob file names it)."""
        self.next_seq = max(self.next_seq, seq + 1)

    @property
    def last_seq(self) -> int:
        return self.next_seq - 1

    @property
    def bytes_on_disk(self) -> int:
        """Bytes of the segment being written (older ones are whole segments)."""
        return self._pos + max(0, len(self._segments) - 1) * SEGMENT_BYTES

    def roll(self) -> None:
        """Start the next segment now (on the appending thread; ``sync`` makes it durable);
        nothing when the current one holds no record yet (it is the next one already)."""
        if self._fd >= 0 and self._first == self.next_seq:
            return
        try:
            self._start_segment()
        except OSError as exc:
            raise _failure(exc) from None

    def trim(self, through_seq: int, *, keep: frozenset[int] = frozenset()) -> set[int]:
        """Delete the segments whose records are all at or below ``through_seq``; which.
        They must be synced (``sync``) first: their records are folded into blob files.
        Those in ``keep`` (they hold records of a damaged blob, which no fold took) are moved
        into ``writes/damaged/`` instead."""
        with self._lock:
            segments, current = list(self._segments), self._first
        gone: set[int] = set()
        for i, first in enumerate(segments):
            nxt = segments[i + 1] if i + 1 < len(segments) else None
            if nxt is not None and nxt - 1 <= through_seq and first != current:
                path = os.path.join(self.dir, segment_name(first))
                if first in keep:
                    dest = self._damaged_dir_ready()
                    self.ops.rename(path, os.path.join(
                        dest, free_name(self.ops, dest, segment_name(first))))
                    self.ops.fsync_dir(dest)
                else:
                    self.ops.unlink(path)
                gone.add(first)
        if gone:
            with self._lock:
                self._segments = [s for s in self._segments if s not in gone]
                for first in gone:
                    fd = self._readers.pop(first, None)
                    if fd is not None:
                        self.ops.close(fd)
            self.ops.fsync_dir(self.dir)
        return gone

    @property
    def damaged_dir(self) -> str:
        """``writes/damaged/``: what a replay or a trim kept that no replay reads again."""
        return os.path.join(os.path.dirname(self.dir), DAMAGED_DIR)

    def _damaged_dir_ready(self) -> str:
        return kept_dir(self.ops, self.damaged_dir)

    def close(self) -> None:
        with self._sync_lock, self._lock:
            for fd in [*self._unsynced, self._fd, *self._readers.values()]:
                if fd >= 0:
                    self.ops.close(fd)
            self._unsynced, self._fd, self._readers = [], -1, {}


def read_record(ops: FileOps, fd: int, pos: int, size: int,
                segment: int) -> tuple[Record | None, int, str]:
    """The record at ``pos``, its length and, when it is None, why (``bad_data`` when
    only its data does not verify)."""
    raw = ops.pread(fd, HEAD_LEN, pos)
    try:
        seq, kind, tag_len, name_len, off, length, digest, check = decode_head(raw)
    except CorruptionError as exc:
        return None, 0, exc.message
    data_bytes = data_len(kind, length)
    total = HEAD_LEN + tag_len + name_len + data_bytes
    if pos + total > size:
        return None, 0, f"a record of {total} bytes, {size - pos} left"
    rest = ops.pread(fd, tag_len + name_len + data_bytes, pos + HEAD_LEN)
    names = rest[:tag_len + name_len]
    if xxhash.xxh3_64_intdigest(raw[:_HEAD.size] + names) != check:
        return None, 0, "record header checksum mismatch"
    try:
        tag = names[:tag_len].decode("utf-8")
        name = names[tag_len:].decode("utf-8")
    except UnicodeDecodeError:
        return None, 0, "record names are not UTF-8"
    data = rest[tag_len + name_len:]
    bad = bool(data_bytes) and xxhash.xxh3_64_intdigest(data) != digest
    return Record(seq, kind, tag, name, off, length, b"" if bad else bytes(data),
                  digest if kind == KIND_BLOB else 0, segment, pos + HEAD_LEN + tag_len
                  + name_len, digest if kind == KIND_WRITE else 0, bad), total, ""


def _pieces(ops: FileOps, fd: int, start: int, end: int) -> Iterator[bytes]:
    at = start
    while at < end:
        piece = ops.pread(fd, min(SCAN_STEP, end - at), at)
        if not piece:
            return
        yield piece
        at += len(piece)


def magic_positions(ops: FileOps, fd: int, start: int, end: int) -> Iterator[int]:
    """Where a record's magic lies in bytes ``[start, end)``, in order."""
    at = start
    while at < end:
        piece = ops.pread(fd, min(SCAN_STEP + len(MAGIC) - 1, end - at), at)
        if not piece:
            return
        i = piece.find(MAGIC_PREFIX)
        while 0 <= i < SCAN_STEP:
            yield at + i
            i = piece.find(MAGIC_PREFIX, i + 1)
        at += SCAN_STEP


def _failure(exc: OSError) -> FaultfsError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreFull("the store has no room for the write")
    return FaultfsError(f"the write journal failed: {exc.strerror}", exc.errno or errno.EIO)
