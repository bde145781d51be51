"""Framed records: a header that starts with a magic and a version, a body, and an IEEE CRC-32
(``zlib.crc32``) of everything before it in the last four bytes — the shape of the stream's
sidecars (the partition record, the shuffle record's header, a carried shuffle).

Invariants:
- ``unframe`` judges, in order, the length (the header and the CRC at least), the magic, the
  version and the CRC, and reports the first failure as ``CorruptionError("<where>: damaged
  <what>: <why>")``; it raises nothing else, so a decoder checks its own fields only after.
- ``frame(body)`` is what ``unframe`` accepts: ``body`` and its CRC.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any

from faultfs.errors import CorruptionError

_CRC = struct.Struct("<I")
CRC_SIZE = _CRC.size


def damaged(where: str, what: str, why: str) -> CorruptionError:
    """The refusal of a damaged record, in the words every framed record uses."""
    return CorruptionError(f"{where}: damaged {what}: {why}")


def frame(body: bytes) -> bytes:
    return body + _CRC.pack(zlib.crc32(body))


def unframe(
    data: bytes, where: str, what: str, head: struct.Struct, magic: bytes, version: int,
    *, at: int = 0,
) -> tuple[Any, ...]:
    """The fields of the header ``head`` (magic and version first) at ``at`` of ``data``,
    whose last four bytes are the CRC of ``data[at:-4]``; CorruptionError otherwise."""
    least = at + head.size + CRC_SIZE
    if len(data) < least:
        raise damaged(where, what, f"{len(data)} bytes, shorter than the {least}-byte minimum")
    fields = head.unpack_from(data, at)
    if fields[0] != magic:
        raise damaged(where, what, f"bad magic {fields[0]!r}")
    if fields[1] != version:
        raise damaged(where, what, f"version {fields[1]}, this faultfs reads version {version}")
    (crc,) = _CRC.unpack_from(data, len(data) - CRC_SIZE)
    if zlib.crc32(data[at:-CRC_SIZE]) != crc:
        raise damaged(where, what, "bad checksum")
    return tuple(fields)
