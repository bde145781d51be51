"""The blob file format: one self-describing, checksummed file per staged blob.

Layout (little-endian), pinned by a golden-bytes test — change it and bump ``VERSION``:

    0    magic         8   b"FFSBLOB\\x00"
    8    version       u16 (1)
    10   flags         u16 (1 dirty, 2 all-zero: no payload stored, 4 no-fault)
    12   header_len    u32 (4096: the payload starts page-aligned)
    16   payload_len   u64 logical bytes of the blob
    24   stored_len    u64 bytes stored after the header (0 when all-zero, else payload_len)
    32   payload_xxh3  u64 xxh3_64 of the payload (0 when all-zero)
    40   tag_len u16, name_len u16, version_len u16, reserved u16 (0)
    48   tag, name, source version (UTF-8), then zeros up to 4088
    4088 header_xxh3   u64 xxh3_64 of bytes [0, 4088)
    4096 payload

Invariant: a file is served only when magic, version, both checksums, the lengths, the file
size and the expected tag and name all agree. Anything else is "not a blob of ours".
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from faultfs.errors import CorruptionError

MAGIC = b"FFSBLOB\x00"
VERSION = 1
HEADER_LEN = 4096  # payload page-aligned: a 128 KiB read touches exactly 32 pages
FLAG_DIRTY = 1  # written by a user: never evicted, never re-faulted
FLAG_ALL_ZERO = 2  # payload is all zeros and not stored
FLAG_NO_FAULT = 4  # stored by the fault path (upstream's kNoFault)
KNOWN_FLAGS = FLAG_DIRTY | FLAG_ALL_ZERO | FLAG_NO_FAULT
MAX_FIELD = 1024  # tag and blob names are <= 255 bytes; a version token is short
_FIXED = struct.Struct("<8sHHIQQQHHHH")
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

    @property
    def dirty(self) -> bool:
        return bool(self.flags & FLAG_DIRTY)

    @property
    def all_zero(self) -> bool:
        return bool(self.flags & FLAG_ALL_ZERO)


def payload_hash(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def is_all_zero(data: bytes | memoryview) -> bool:
    raw = data.tobytes() if isinstance(data, memoryview) else data
    if raw[:8].strip(b"\0") or raw[-8:].strip(b"\0"):
        return False  # the common case: real data decides at its first bytes
    return raw.count(0) == len(raw)


def encode_header(tag: str, name: str, payload: bytes | memoryview, *, flags: int,
                  source_version: str = "") -> tuple[bytes, bool]:
    """The header for ``payload``; returns ``(header, store_payload)``."""
    zero = is_all_zero(payload)
    if zero:
        flags |= FLAG_ALL_ZERO
    else:
        flags &= ~FLAG_ALL_ZERO
    fields = [s.encode("utf-8", "surrogateescape") for s in (tag, name, source_version)]
    if any(len(f) > MAX_FIELD for f in fields):
        raise CorruptionError("blob header field too long")
    n = len(payload)
    stored = 0 if zero else n
    digest = 0 if zero else payload_hash(payload)
    head = _FIXED.pack(MAGIC, VERSION, flags, HEADER_LEN, n, stored, digest,
                       len(fields[0]), len(fields[1]), len(fields[2]), 0)
    body = head + b"".join(fields)
    body += bytes(_CHECK_AT - len(body))
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)), not zero


def decode_header(raw: bytes, *, file_size: int | None = None) -> BlobHeader:
    """Parse and verify a header; CorruptionError says what is wrong."""
    if len(raw) < HEADER_LEN:
        raise CorruptionError(f"blob header truncated ({len(raw)} of {HEADER_LEN} bytes)")
    raw = raw[:HEADER_LEN]
    (magic, version, flags, header_len, n, stored, digest,
     tag_len, name_len, ver_len, reserved) = _FIXED.unpack_from(raw)
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
    if stored != (0 if all_zero else n):
        raise CorruptionError(f"blob stored length {stored} does not match payload {n}")
    if max(tag_len, name_len, ver_len) > MAX_FIELD or _FIXED.size + tag_len + name_len + ver_len > _CHECK_AT:
        raise CorruptionError("blob header names overflow the header")
    if file_size is not None and file_size != HEADER_LEN + stored:
        raise CorruptionError(f"blob file is {file_size} bytes, header says {HEADER_LEN + stored}")
    pos = _FIXED.size
    parts = []
    for length in (tag_len, name_len, ver_len):
        parts.append(raw[pos:pos + length].decode("utf-8", "surrogateescape"))
        pos += length
    return BlobHeader(parts[0], parts[1], n, flags, parts[2], digest, stored)
