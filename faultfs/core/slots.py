"""DiskSlot: the 64-byte checksummed checkpoint record, two of which make a ``.meta`` file.

Invariants:
- Byte-exact layout (DESIGN §9, docs/FORMAT-cursors.md), little-endian:
  ``magic b"LMDL" @0, version u32 @4, epoch u64 @8, committed_batch_id u64 @16,
  coord [32] @24, dedup_count u32 @56, crc32 u32 @60``; the CRC is IEEE CRC-32
  (``zlib.crc32``) over bytes 0..60. A golden test pins it.
- Decoding never raises on bad bytes: it returns a ``SlotReading`` that says the slot is valid
  or exactly why not (all-zero, bad magic, bad version, bad CRC, wrong length), so recovery
  and ``faultfs checkpoint show`` share one judgement.
- Which slot an epoch lives in is fixed: odd epochs in slot A (offset 0), even in slot B (64).
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass

from faultfs.core.coord import COORD_SIZE, U32_MAX, U64_MAX, StreamCoordinate
from faultfs.errors import InvalidInput

SLOT_SIZE = 64  # two slots fill the 128-byte .meta file
META_SIZE = 2 * SLOT_SIZE
SLOT_MAGIC = b"LMDL"  # shared with the original engine, so its files interoperate
SLOT_VERSION = 1  # bump on any layout change; the golden test says so
SLOT_A_OFFSET = 0
SLOT_B_OFFSET = SLOT_SIZE

_HEAD = struct.Struct("<4sIQQ")  # magic, version, epoch, committed_batch_id: bytes 0..24
_TAIL = struct.Struct("<I")  # dedup_count at 56, crc32 at 60
_CRC_SPAN = 60
assert _HEAD.size + COORD_SIZE + 2 * _TAIL.size == SLOT_SIZE


class SlotStatus(enum.Enum):
    VALID = "valid"
    ALL_ZERO = "all-zero"  # never written: a fresh file
    BAD_LENGTH = "bad length"
    BAD_MAGIC = "bad magic"
    BAD_VERSION = "bad version"
    BAD_CRC = "bad crc"  # typically a write torn by a crash


@dataclass(frozen=True)
class DiskSlot:
    """One checkpoint: the commit sequence number, the last consumed batch, where to resume,
    and how many 8-byte hashes of the dedup WAL are committed."""

    epoch: int
    committed_batch_id: int
    coord: StreamCoordinate
    dedup_count: int

    def __post_init__(self) -> None:
        for name, limit in (
            ("epoch", U64_MAX),
            ("committed_batch_id", U64_MAX),
            ("dedup_count", U32_MAX),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
                raise InvalidInput(f"DiskSlot.{name}={value!r} out of range 0..{limit}")
        if not isinstance(self.coord, StreamCoordinate):
            raise InvalidInput("DiskSlot.coord must be a StreamCoordinate")

    @property
    def offset(self) -> int:
        """Byte offset of this slot in the .meta file, fixed by the epoch's parity."""
        return slot_offset_for_epoch(self.epoch)

    def encode(self) -> bytes:
        body = (
            _HEAD.pack(SLOT_MAGIC, SLOT_VERSION, self.epoch, self.committed_batch_id)
            + self.coord.encode()
            + _TAIL.pack(self.dedup_count)
        )
        return body + _TAIL.pack(zlib.crc32(body))


@dataclass(frozen=True)
class SlotReading:
    """The verdict on 64 bytes read from a slot position: the slot if valid, else why not."""

    status: SlotStatus
    slot: DiskSlot | None = None
    detail: str = ""

    @property
    def valid(self) -> bool:
        return self.status is SlotStatus.VALID

    def describe(self) -> str:
        if self.slot is not None:
            return "valid"
        return f"{self.status.value}: {self.detail}" if self.detail else self.status.value


def slot_offset_for_epoch(epoch: int) -> int:
    """Odd epochs live in slot A, even epochs in slot B (the first commit is epoch 1)."""
    return SLOT_A_OFFSET if epoch % 2 == 1 else SLOT_B_OFFSET


def decode_slot(data: bytes | bytearray | memoryview) -> SlotReading:
    """Judge 64 bytes: valid (with the slot) or the first reason they are not."""
    raw = bytes(data)
    if len(raw) != SLOT_SIZE:
        return SlotReading(
            SlotStatus.BAD_LENGTH, detail=f"expected {SLOT_SIZE} bytes, got {len(raw)}"
        )
    if raw == bytes(SLOT_SIZE):
        return SlotReading(SlotStatus.ALL_ZERO)
    magic, version, epoch, batch_id = _HEAD.unpack_from(raw, 0)
    if magic != SLOT_MAGIC:
        return SlotReading(SlotStatus.BAD_MAGIC, detail=f"{magic!r} != {SLOT_MAGIC!r}")
    if version != SLOT_VERSION:
        return SlotReading(SlotStatus.BAD_VERSION, detail=f"{version} != {SLOT_VERSION}")
    (stored_crc,) = _TAIL.unpack_from(raw, _CRC_SPAN)
    actual_crc = zlib.crc32(raw[:_CRC_SPAN])
    if stored_crc != actual_crc:
        return SlotReading(
            SlotStatus.BAD_CRC, detail=f"stored {stored_crc:08x}, computed {actual_crc:08x}"
        )
    coord = StreamCoordinate.decode(raw[_HEAD.size : _HEAD.size + COORD_SIZE])
    (dedup_count,) = _TAIL.unpack_from(raw, _HEAD.size + COORD_SIZE)
    return SlotReading(SlotStatus.VALID, DiskSlot(epoch, batch_id, coord, dedup_count))
