"""The write journal's segments as the walk checks them (``writes/journal/w-<seq>.log``):
records verified as a replay reads them (``store/journal.py``), in order, across segments.

Invariants:
- Seqs rise across segments, which are read in the order their names give; the first record
  that does not verify stops the replay, so every segment after it is reported as not
  replayed.
- Where the replay stops is judged as the mount judges it (``Journal.replay``): when no
  whole record that verifies follows anywhere (the rest of the segment, the later ones), it
  is a *torn tail* — what a crash cut while appending, never an answered write — which the
  next mount cuts off: a ``LEFTOVER``, no problem. When records that verify follow, it is
  damage (the mount keeps them in ``writes/damaged/``).
- ``blob_records`` and ``next_seq`` say, once the walk is over, which whole-chunk records the
  replay would reach and the seq the journal goes on from: a direct file no record names is
  an unanswered write's (``writes.py``).
- Record data is hashed in pieces of at most ``READ_STEP`` (a record may carry a whole
  blob); only the segments' names and the whole-chunk records' seqs are held (one per 64
  MiB of journal; at most one per record since the last checkpoint).
- Every finding is kept (``KEEP_JOURNAL``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import xxhash

from faultfs.errors import CorruptionError
from faultfs.store.entries import ForeignEntry, open_regular
from faultfs.store.fileops import OsFileOps
from faultfs.store.fsck.blobs import READ_STEP
from faultfs.store.fsck.findings import DAMAGED, JOURNAL, KEEP_JOURNAL, LEFTOVER, OK, Finding
from faultfs.store.fsck.look import kind, lsize, scan, unknown_finding
from faultfs.store.journal import (
    DAMAGED_DIR,
    HEAD_LEN,
    KIND_BLOB,
    SEGMENT_PREFIX,
    SEGMENT_SUFFIX,
    data_len,
    decode_head,
    magic_positions,
)

_OPS = OsFileOps()  # plain reads, for the journal's own scan for record heads


class JournalWalk:
    """The findings of the journal's segments (``findings``), and what the replay would
    reach (``blob_records``, ``next_seq``) once they were all made."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.blob_records: set[tuple[str, int]] = set()  # (tag, seq) of whole-chunk records
        self.next_seq = 1  # the seq the journal goes on from after the replay

    def findings(self) -> Iterator[Finding]:
        """Segments in seq order, records verified as a replay reads them (``journal.py``):
        in order, seqs rising, up to the first record that does not verify."""
        segments: list[tuple[int, str]] = []
        for entry in scan(self.directory):
            first = _segment_seq(entry.name)
            if first is None:
                yield unknown_finding(entry.path)
            else:
                segments.append((first, entry.path))
        segments.sort()
        expect = 1
        stopped = ""
        torn = False
        for i, (first, path) in enumerate(segments):
            mode, size = lsize(path)
            name = os.path.basename(path)
            if stopped and torn:
                yield Finding(JOURNAL, LEFTOVER, path, size,
                              f"journal segment {name}: follows {stopped}, with no record "
                              "that verifies: the next mount deletes it", KEEP_JOURNAL)
                continue
            if stopped:
                yield Finding(JOURNAL, DAMAGED, path, size,
                              f"journal segment {name}: follows {stopped}: not replayed (the "
                              f"next mount keeps it in writes/{DAMAGED_DIR}/ if its records "
                              "verify, else deletes it)", KEEP_JOURNAL)
                continue
            self.next_seq = max(self.next_seq, first)
            try:
                fd = open_regular(path)
            except ForeignEntry:
                yield Finding(JOURNAL, DAMAGED, path, size, f"{kind(mode)} stands where "
                              f"journal segment {name} should be", KEEP_JOURNAL)
                stopped = f"journal segment {name}, which is not a file"
                continue
            if fd is None:
                continue
            try:
                expect = max(expect, first)
                scanned = _SegmentScan(fd, os.fstat(fd).st_size, expect, self.blob_records)
                scanned.run()
                torn = bool(scanned.problem) and not _verifies_after(
                    fd, scanned.pos, scanned.size, [p for _, p in segments[i + 1:]])
            finally:
                os.close(fd)
            expect = scanned.expect
            self.next_seq = max(self.next_seq, expect)
            if not scanned.problem:
                yield Finding(JOURNAL, OK, path, size)
                continue
            after = f"after {scanned.records} good records"
            if torn:
                yield Finding(JOURNAL, LEFTOVER, path, size,
                              f"journal segment {name}: torn tail at byte {scanned.pos} {after} "
                              f"({scanned.problem}; {size - scanned.pos} bytes, no record that "
                              "verifies after it): what a crash cut while appending, never "
                              "an answered write; the next mount cuts it off", KEEP_JOURNAL)
                stopped = f"the torn tail of {name}"
            else:
                yield Finding(JOURNAL, DAMAGED, path, size,
                              f"journal segment {name}: the record at byte {scanned.pos} "
                              f"{after} does not verify ({scanned.problem}): the "
                              f"{size - scanned.pos} bytes from there are not replayed (records "
                              f"that verify follow: the next mount keeps them in writes/"
                              f"{DAMAGED_DIR}/; a write's bad data is passed over instead "
                              "when its blob is one its tag's write state names damaged, or "
                              "was reset since)", KEEP_JOURNAL)
                stopped = f"a record that does not verify in {name}"


def _verifies_after(fd: int, pos: int, size: int, later: list[str]) -> bool:
    """Whether a whole record that verifies lies after byte ``pos`` of the segment open at
    ``fd`` or anywhere in the ``later`` segments (found by its magic, as the mount looks)."""
    if any(_SegmentScan(fd, size, 0, set()).verifies_at(at)
           for at in magic_positions(_OPS, fd, pos + 1, size)):
        return True
    for path in later:
        try:
            other = open_regular(path)
        except ForeignEntry:
            continue
        if other is None:
            continue
        try:
            end = os.fstat(other).st_size
            scan_ = _SegmentScan(other, end, 0, set())
            if any(scan_.verifies_at(at) for at in magic_positions(_OPS, other, 0, end)):
                return True
        finally:
            os.close(other)
    return False


def _segment_seq(name: str) -> int | None:
    """The first seq a segment's name says (``w-<16 hex>.log``), else None."""
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)]
    if len(digits) != 16 or any(c not in "0123456789abcdef" for c in digits.lower()):
        return None
    return int(digits, 16)


class _SegmentScan:
    """Verify one segment's records as ``Journal.replay`` reads them, data hashed in pieces
    (a record may carry a whole blob): ``problem`` says why it stopped, at ``pos``. The
    whole-chunk records it passes go into ``blobs`` as ``(tag, seq)``."""

    def __init__(self, fd: int, size: int, expect: int, blobs: set[tuple[str, int]]) -> None:
        self.fd, self.size, self.expect, self.blobs = fd, size, expect, blobs
        self.pos = 0
        self.records = 0
        self.problem = ""

    def run(self) -> None:
        while self.pos < self.size:
            problem, total, seq, kind, tag = self._record(self.pos)
            if not problem and seq < self.expect:
                problem = f"seq {seq} after {self.expect - 1}"
            if problem:
                self.problem = problem
                return
            if kind == KIND_BLOB:
                self.blobs.add((tag, seq))
            self.expect = seq + 1
            self.records += 1
            self.pos += total

    def verifies_at(self, pos: int) -> bool:
        """Whether a whole record that verifies starts at ``pos``."""
        return not self._record(pos)[0]

    def _record(self, pos: int) -> tuple[str, int, int, int, str]:
        """``(problem, length, seq, kind, tag)`` of the record at ``pos``; ``problem`` is ""
        when it verifies whole."""
        left = self.size - pos
        if left < HEAD_LEN:
            return f"a partial record of {left} bytes", 0, 0, 0, ""
        raw = os.pread(self.fd, HEAD_LEN, pos)
        try:
            seq, kind, tag_len, name_len, _off, length, digest, check = decode_head(raw)
        except CorruptionError as exc:
            return exc.message, 0, 0, 0, ""
        total = HEAD_LEN + tag_len + name_len + data_len(kind, length)
        if total > left:
            return f"a record of {total} bytes, {left} left", 0, 0, 0, ""
        names = os.pread(self.fd, tag_len + name_len, pos + HEAD_LEN)
        if xxhash.xxh3_64_intdigest(raw[:HEAD_LEN - 8] + names) != check:
            return "record header checksum mismatch", 0, 0, 0, ""
        try:
            tag = names[:tag_len].decode("utf-8")
            names[tag_len:].decode("utf-8")
        except UnicodeDecodeError:
            return "record names are not UTF-8", 0, 0, 0, ""
        if data_len(kind, length) and self._data_digest(pos + HEAD_LEN + len(names),
                                                    length) != digest:
            return "record data checksum mismatch", 0, 0, 0, ""
        return "", total, seq, kind, tag

    def _data_digest(self, off: int, length: int) -> int:
        if not length:
            return 0
        digest = xxhash.xxh3_64()
        done = 0
        while done < length:
            piece = os.pread(self.fd, min(READ_STEP, length - done), off + done)
            if not piece:
                break
            digest.update(piece)
            done += len(piece)
        return digest.intdigest()
