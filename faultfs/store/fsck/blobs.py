"""Reading one blob file as the walk checks it: the header (its tag and name as the caller
expects), then, when verifying, every block and the whole-payload checksum.

Invariants:
- Payloads are read in pieces of at most ``READ_STEP`` into one reused buffer: memory stays
  flat whatever the blob's size; a payload is kept only when the caller asked for it and it
  is at most the size it named.
- A file is opened with ``open_regular``: a link or anything but a regular file is reported
  (``foreign``), never followed or read.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import unquote

import xxhash

from faultfs.errors import CorruptionError
from faultfs.store.blobfile import HEADER_LEN, BlobHeader, decode_header
from faultfs.store.entries import ForeignEntry, encode_component, open_regular
from faultfs.store.fsck.look import kind, lsize

READ_STEP = 4 << 20  # payloads are verified in pieces of this much: memory stays flat


@dataclass
class BlobCheck:
    """What reading one blob file found."""

    header: BlobHeader | None
    problem: str = ""  # "" when it verifies
    foreign: bool = False  # not a regular file: no data at all
    payload: bytes | None = None  # the payload, when it was asked for and verifies


def blob_name(entry_name: str) -> tuple[str | None, bool]:
    """``(name, hashed)`` a blob file's name says; name None for a hashed name (the header
    says it) or for a name the store would never look up (not canonically encoded)."""
    if entry_name.startswith("h-"):
        return None, True
    name = unquote(entry_name[2:])
    return (name if encode_component("b-", name) == entry_name else None), False


class BlobReader:
    """Blob files read and checked one at a time. ``verify``: read every payload and check
    every block and the whole-payload checksum (fsck); without it only headers (gc)."""

    def __init__(self, *, verify: bool) -> None:
        self.verify = verify
        self._buf = bytearray()  # grown to the largest piece read, at most READ_STEP

    def read(self, path: str, *, owners: Callable[[str], bool], name: str | None,
             keep_payload: int = 0, verify: bool | None = None) -> BlobCheck:
        """Read and verify one blob file. ``owners(tag)``: whether the header's tag may own
        it; ``name``: the blob it must hold (None: any, for a hashed file name, checked by
        the caller); ``keep_payload``: return payloads up to this size."""
        verify = self.verify if verify is None else verify
        try:
            fd = open_regular(path)
        except ForeignEntry:
            mode, _ = lsize(path)
            return BlobCheck(None, f"{kind(mode)} stands where a blob file should be",
                             foreign=True)
        if fd is None:
            return BlobCheck(None, "vanished while it was checked")
        try:
            size = os.fstat(fd).st_size
            try:
                header = decode_header(os.pread(fd, HEADER_LEN, 0), file_size=size)
            except CorruptionError as exc:
                return BlobCheck(None, exc.message)
            if not owners(header.tag):
                return BlobCheck(header, f"holds a blob of tag {header.tag!r}")
            if name is not None and header.name != name:
                return BlobCheck(header, f"holds blob {header.name!r}")
            if not verify:
                return BlobCheck(header)
            return self._verify_payload(fd, header, keep_payload)
        finally:
            os.close(fd)

    def _verify_payload(self, fd: int, header: BlobHeader, keep_payload: int) -> BlobCheck:
        keep = header.payload_len <= keep_payload
        if header.all_zero:
            return BlobCheck(header, payload=bytes(header.payload_len) if keep else None)
        block = header.block_size
        step = max(block, READ_STEP // block * block)
        need = min(step, header.stored_len)
        if len(self._buf) < need:
            self._buf = bytearray(need)
        view = memoryview(self._buf)
        digest = xxhash.xxh3_64()
        kept = bytearray() if keep else None
        off = 0
        while off < header.stored_len:
            want = min(step, header.stored_len - off)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], HEADER_LEN + off + got)
                if n == 0:
                    return BlobCheck(header, "is shorter than its header says")
                got += n
            piece = view[:want]
            try:
                header.check_blocks(off // block, piece)
            except CorruptionError as exc:
                return BlobCheck(header, exc.message.split(": ", 1)[-1])
            digest.update(piece)
            if kept is not None:
                kept += piece
            off += want
        if digest.intdigest() != header.payload_xxh3:
            return BlobCheck(header, "payload checksum mismatch")
        return BlobCheck(header, payload=bytes(kept) if kept is not None else None)
