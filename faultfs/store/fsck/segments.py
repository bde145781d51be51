"""The write journal's segments as the walk checks them (``writes/journal/w-<seq>.log``):
records verified as a replay reads them (``store/journal.py``), in order, across segments.

Invariants:
- Seqs rise across segments, which are read in the order their names give; the first record
  that does not verify stops the replay, so every segment after it is reported as not
  replayed.
- A partial record at the end of the last segment is a *torn tail* (a crash while appending:
  the next mount cuts it off); a bad record anywhere else is damage.
- Record data is hashed in pieces of at most ``READ_STEP`` (a record may carry a whole
  blob); only the segments' names are held (one per 64 MiB of journal).
- Every finding is kept (``KEEP_JOURNAL``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import xxhash

from faultfs.errors import CorruptionError
from faultfs.store.entries import ForeignEntry, open_regular
from faultfs.store.fsck.blobs import READ_STEP
from faultfs.store.fsck.findings import DAMAGED, JOURNAL, KEEP_JOURNAL, OK, Finding
from faultfs.store.fsck.look import kind, lsize, scan, unknown_finding
from faultfs.store.journal import (
    DAMAGED_DIR,
    HEAD_LEN,
    SEGMENT_PREFIX,
    SEGMENT_SUFFIX,
    data_len,
    decode_head,
)


def segment_findings(directory: str) -> Iterator[Finding]:
    """Segments in seq order, records verified as a replay reads them (``journal.py``):
    in order, seqs rising, up to the first record that does not verify."""
    segments: list[tuple[int, str]] = []
    for entry in scan(directory):
        first = _segment_seq(entry.name)
        if first is None:
            yield unknown_finding(entry.path)
        else:
            segments.append((first, entry.path))
    segments.sort()
    expect = 1
    stopped = ""
    for i, (first, path) in enumerate(segments):
        mode, size = lsize(path)
        name = os.path.basename(path)
        if stopped:
            yield Finding(JOURNAL, DAMAGED, path, size,
                          f"journal segment {name}: follows {stopped}: not replayed (the "
                          f"next mount keeps it in writes/{DAMAGED_DIR}/ if its records "
                          "verify, else deletes it)", KEEP_JOURNAL)
            continue
        try:
            fd = open_regular(path)
        except ForeignEntry:
            yield Finding(JOURNAL, DAMAGED, path, size, f"{kind(mode)} stands where journal "
                          f"segment {name} should be", KEEP_JOURNAL)
            stopped = f"journal segment {name}, which is not a file"
            continue
        if fd is None:
            continue
        try:
            expect = max(expect, first)
            scanned = _SegmentScan(fd, os.fstat(fd).st_size, expect,
                                   last=i == len(segments) - 1)
            scanned.run()
        finally:
            os.close(fd)
        expect = scanned.expect
        if not scanned.problem:
            yield Finding(JOURNAL, OK, path, size)
            continue
        after = f"after {scanned.records} good records"
        if scanned.torn:
            yield Finding(JOURNAL, DAMAGED, path, size,
                          f"journal segment {name}: torn tail at byte {scanned.pos} {after} "
                          f"({scanned.problem}; {size - scanned.pos} bytes): the next mount "
                          "cuts it off", KEEP_JOURNAL)
        else:
            yield Finding(JOURNAL, DAMAGED, path, size,
                          f"journal segment {name}: the record at byte {scanned.pos} {after} "
                          f"does not verify ({scanned.problem}): the {size - scanned.pos} "
                          "bytes from there are not replayed (the next mount keeps them in "
                          f"writes/{DAMAGED_DIR}/ if records that verify follow, else cuts "
                          "them off; a write's bad data is passed over instead when its "
                          "blob is one its tag's write state names damaged, or was reset "
                          "since)", KEEP_JOURNAL)
        stopped = f"a record that does not verify in {name}"


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
    (a record may carry a whole blob): ``problem`` says why it stopped, at ``pos``; ``torn``
    when that is a partial last record of the last segment (a crash while appending)."""

    def __init__(self, fd: int, size: int, expect: int, *, last: bool) -> None:
        self.fd, self.size, self.expect, self.last = fd, size, expect, last
        self.pos = 0
        self.records = 0
        self.problem = ""
        self.torn = False

    def _stop(self, problem: str, *, torn: bool) -> None:
        self.problem = problem
        self.torn = self.last and torn

    def run(self) -> None:
        while self.pos < self.size:
            left = self.size - self.pos
            if left < HEAD_LEN:
                return self._stop(f"a partial record of {left} bytes", torn=True)
            raw = os.pread(self.fd, HEAD_LEN, self.pos)
            try:
                seq, kind, tag_len, name_len, _off, length, digest, check = decode_head(raw)
            except CorruptionError as exc:
                return self._stop(exc.message, torn=self._zeros_to_end())
            total = HEAD_LEN + tag_len + name_len + data_len(kind, length)
            if total > left:
                return self._stop(f"a record of {total} bytes, {left} left", torn=True)
            names = os.pread(self.fd, tag_len + name_len, self.pos + HEAD_LEN)
            if xxhash.xxh3_64_intdigest(raw[:HEAD_LEN - 8] + names) != check:
                return self._stop("record header checksum mismatch", torn=total == left)
            try:
                names.decode("utf-8")
            except UnicodeDecodeError:
                return self._stop("record names are not UTF-8", torn=False)
            if seq < self.expect:
                return self._stop(f"seq {seq} after {self.expect - 1}", torn=False)
            if data_len(kind, length) and self._data_digest(
                    self.pos + HEAD_LEN + len(names), length) != digest:
                return self._stop("record data checksum mismatch", torn=total == left)
            self.expect = seq + 1
            self.records += 1
            self.pos += total
        return None

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

    def _zeros_to_end(self) -> bool:
        """Whether everything from ``pos`` on is zeros (space a crash left unwritten)."""
        off = self.pos
        while off < self.size:
            piece = os.pread(self.fd, min(READ_STEP, self.size - off), off)
            if not piece or piece.count(0) != len(piece):
                return False
            off += len(piece)
        return True
