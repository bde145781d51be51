"""The blob file format: one self-describing, checksummed file per staged blob.

Layout (little-endian), pinned by a golden-bytes test — change it and bump ``VERSION``:

    0    magic         8   b"FFSBLOB\\x00"
    8    version       u16 (1)
    10   flags         u16 (1 dirty, 2 all-zero: no payload stored, 4 no-fault)
    12   header_len    u32 (4096: the payload starts page-aligned)
    16   payload_len   u64 logical bytes of the blob
    24   stored_len    u64 bytes stored after the header (0 when all-zero, else payload_len)
    32   payload_xxh3  u64 xxh3_64 of the whole payload (0 when all-zero)
    40   tag_len u16, name_len u16, version_len u16, block_count u16
    48   block_size    u32 bytes per checksummed block (a multiple of 4096)
    52   reserved      u32 (0)
    56   tag, name, source version (UTF-8)
    2048 block checksums: block_count x u64, xxh3_64 of each payload block
    ...  zeros up to 4088
    4088 header_xxh3   u64 xxh3_64 of bytes [0, 4088)
    4096 payload

Invariants:
- A file is used only when magic, version, header checksum, lengths, file size and the
  expected tag and name all agree.
- Every payload byte served has been checked against its block's checksum in the same read:
  a 4 KiB read of a staged blob verifies one block, not the whole blob.
"""

from __future__ import annotations

import array
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from faultfs.core.context import MAX_CHUNK_SIZE
from faultfs.errors import CorruptionError

MAGIC = b"FFSBLOB\x00"
VERSION = 1
HEADER_LEN = 4096  # payload page-aligned: a 128 KiB read touches exactly 32 pages
FLAG_DIRTY = 1  # written by a user: never evicted, never re-faulted
FLAG_ALL_ZERO = 2  # payload is all zeros and not stored
FLAG_NO_FAULT = 4  # stored by the fault path (upstream's kNoFault)
KNOWN_FLAGS = FLAG_DIRTY | FLAG_ALL_ZERO | FLAG_NO_FAULT
MIN_BLOCK = 16 << 10  # a random 4 KiB read verifies (and reads) one 16 KiB block
MAX_BLOCKS = 255  # the checksum table fits [2048, 4088) of the header
MAX_NAME = 255  # tag and blob names are NAME_MAX bytes at most
MAX_VERSION = 1024  # a source version token ("<size> etag:...") is short
MAX_PAYLOAD = MAX_CHUNK_SIZE  # a blob is held whole in memory: no payload is longer
TABLE_AT = 2048
_FIXED = struct.Struct("<8sHHIQQQHHHHII")
_CHECK_AT = HEADER_LEN - 8


@dataclass(frozen=True)
class BlobHeader:
    tag: str
    name: str
    payload_len: int
    flags: int = FLAG_NO_FAULT
    source_version: str = ""
    payload_xxh3: int = 0
    stored_len: int = 0
    block_size: int = MIN_BLOCK
    block_sums: Sequence[int] = ()  # an array('Q') when decoded: 8 bytes a block

    @property
    def dirty(self) -> bool:
        return bool(self.flags & FLAG_DIRTY)

    @property
    def all_zero(self) -> bool:
        return bool(self.flags & FLAG_ALL_ZERO)

    def blocks_for(self, off: int, size: int) -> tuple[int, int]:
        """The block range ``[first, last)`` covering payload bytes ``[off, off+size)``."""
        bs = self.block_size
        return off // bs, min(len(self.block_sums), -(-(off + size) // bs))

    def check_blocks(self, first: int, data: bytes | memoryview) -> None:
        """Verify ``data`` (whole blocks from block ``first``) against the table."""
        bs = self.block_size
        view = memoryview(data)
        for i in range(-(-len(view) // bs)):
            if xxhash.xxh3_64_intdigest(view[i * bs:(i + 1) * bs]) != self.block_sums[first + i]:
                what = "dirty blob" if self.dirty else "blob"
                raise CorruptionError(
                    f"{what} {self.name} of tag {self.tag}: block {first + i} failed its checksum")


def block_span(block_size: int, stored_len: int, off: int, size: int) -> tuple[int, int, int]:
    """``(first block, its payload offset, bytes to read)``: the whole blocks that cover
    payload bytes ``[off, off+size)`` (``off`` inside the payload, ``size`` > 0)."""
    first = off // block_size
    start = first * block_size
    return first, start, min(-(-(off + size) // block_size) * block_size, stored_len) - start


def payload_hash(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def block_size_for(length: int) -> int:
    """The smallest multiple of 4 KiB (at least 16 KiB) that cuts ``length`` into at most
    255 blocks."""
    size = max(MIN_BLOCK, -(-length // MAX_BLOCKS))
    return -(-size // 4096) * 4096


def is_all_zero(data: bytes | memoryview) -> bool:
    view = memoryview(data)
    if any(view[:8]) or any(view[-8:]):
        return False  # the common case: real data decides at its first bytes
    step = 64 << 10  # copied in small pieces: the heap reuses them, no page faults
    for i in range(0, len(view), step):
        piece = bytes(view[i:i + step])
        if piece.count(0) != len(piece):
            return False
    return True


def encode_header(tag: str, name: str, payload: bytes | memoryview, *, flags: int,
                  source_version: str = "") -> tuple[bytes, bool]:
    """The header for ``payload``; returns ``(header, store_payload)``."""
    zero = is_all_zero(payload)
    flags = (flags | FLAG_ALL_ZERO) if zero else (flags & ~FLAG_ALL_ZERO)
    fields = [s.encode("utf-8", "surrogateescape") for s in (tag, name, source_version)]
    if len(fields[0]) > MAX_NAME or len(fields[1]) > MAX_NAME or len(fields[2]) > MAX_VERSION:
        raise CorruptionError("blob header field too long")
    n = len(payload)
    stored = 0 if zero else n
    block = block_size_for(stored)
    view = memoryview(payload)
    sums = [] if zero else [xxhash.xxh3_64_intdigest(view[i:i + block])
                            for i in range(0, stored, block)]
    digest = 0 if zero else payload_hash(payload)
    head = _FIXED.pack(MAGIC, VERSION, flags, HEADER_LEN, n, stored, digest,
                       len(fields[0]), len(fields[1]), len(fields[2]), len(sums), block, 0)
    body = bytearray(_CHECK_AT)
    names = head + b"".join(fields)
    body[:len(names)] = names
    table = struct.pack(f"<{len(sums)}Q", *sums)
    body[TABLE_AT:TABLE_AT + len(table)] = table
    return bytes(body) + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)), not zero


def decode_header(raw: bytes, *, file_size: int | None = None) -> BlobHeader:
    """Parse and verify a header; CorruptionError says what is wrong."""
    if len(raw) < HEADER_LEN:
        raise CorruptionError(f"blob header truncated ({len(raw)} of {HEADER_LEN} bytes)")
    raw = raw[:HEADER_LEN]
    (magic, version, flags, header_len, n, stored, digest,
     tag_len, name_len, ver_len, nblocks, block, reserved) = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptionError("not a faultfs blob file (bad magic)")
    if version != VERSION:
        raise CorruptionError(f"blob format version {version} is not {VERSION}")
    (check,) = struct.unpack_from("<Q", raw, _CHECK_AT)
    if check != xxhash.xxh3_64_intdigest(raw[:_CHECK_AT]):
        raise CorruptionError("blob header checksum mismatch")
    if header_len != HEADER_LEN or flags & ~KNOWN_FLAGS or reserved:
        raise CorruptionError("blob header has unknown fields")
    all_zero = bool(flags & FLAG_ALL_ZERO)
    if n > MAX_PAYLOAD:  # an all-zero blob stores only its length: never trust it unbounded
        raise CorruptionError(f"blob payload length {n} is over the limit of {MAX_PAYLOAD}")
    if stored != (0 if all_zero else n):
        raise CorruptionError(f"blob stored length {stored} does not match payload {n}")
    if tag_len > MAX_NAME or name_len > MAX_NAME or ver_len > MAX_VERSION:
        raise CorruptionError("blob header names overflow the header")
    if block != block_size_for(stored) or nblocks != -(-stored // block):
        raise CorruptionError(f"blob block table ({nblocks} x {block}) does not fit {stored} bytes")
    if file_size is not None and file_size != HEADER_LEN + stored:
        raise CorruptionError(f"blob file is {file_size} bytes, header says {HEADER_LEN + stored}")
    pos = _FIXED.size
    parts = []
    for length in (tag_len, name_len, ver_len):
        parts.append(raw[pos:pos + length].decode("utf-8", "surrogateescape"))
        pos += length
    sums = array.array("Q", raw[TABLE_AT:TABLE_AT + 8 * nblocks])  # little-endian on disk
    if sys.byteorder != "little":
        sums.byteswap()
    return BlobHeader(parts[0], parts[1], n, flags, parts[2], digest, stored, block, sums)
