"""StreamCoordinate: the 32-byte little-endian address of a position in a multi-shard stream.

Invariants:
- The wire layout is byte-exact with the original engine (DESIGN §9, docs/FORMAT-cursors.md):
  ``shard_id u32 @0, byte_offset u64 @4, row_group_idx u32 @12, page_idx u32 @16,
  row_offset_in_page u32 @20, global_row_idx u64 @24``; a golden test pins it.
- Every field is an int within its width; a coordinate that cannot be encoded cannot be built.
- ``decode(encode(c)) == c`` for every coordinate, and ``decode`` accepts exactly 32 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields

from faultfs.errors import CorruptionError, InvalidInput

COORD_SIZE = 32  # fixed by the on-disk slot layout (bytes 24..56 of a DiskSlot)
_COORD = struct.Struct("<IQIIIQ")
assert _COORD.size == COORD_SIZE

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
_FIELD_MAX = {
    "shard_id": U32_MAX,
    "byte_offset": U64_MAX,
    "row_group_idx": U32_MAX,
    "page_idx": U32_MAX,
    "row_offset_in_page": U32_MAX,
    "global_row_idx": U64_MAX,
}


_LIMITS = tuple(_FIELD_MAX.items())


def _check_field(name: str, value: object, limit: int) -> None:
    """Why ``value`` cannot be field ``name`` (an int subclass in range can)."""
    # bool is an int subclass but never a meaningful coordinate field
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidInput(f"StreamCoordinate.{name} must be an int, got {type(value).__name__}")
    if not 0 <= value <= limit:
        raise InvalidInput(f"StreamCoordinate.{name}={value} out of range 0..{limit}")


@dataclass(frozen=True)
class StreamCoordinate:
    """Where the next record of a stream starts.

    ``shard_id``: index in the expanded source list. ``byte_offset``: byte offset of the next
    line in a .jsonl/.txt shard. ``row_group_idx``/``row_offset_in_page``: Parquet row group and
    rows of it already consumed. ``page_idx``: reserved (0). ``global_row_idx``: raw records
    scanned across all shards, duplicates included.
    """

    shard_id: int = 0
    byte_offset: int = 0
    row_group_idx: int = 0
    page_idx: int = 0
    row_offset_in_page: int = 0
    global_row_idx: int = 0

    def __post_init__(self) -> None:
        for name, limit in _LIMITS:  # a plain int in range passes at once (one per batch)
            value = getattr(self, name)
            if type(value) is not int or not 0 <= value <= limit:
                _check_field(name, value, limit)

    def encode(self) -> bytes:
        """The 32-byte little-endian wire form."""
        return _COORD.pack(
            self.shard_id,
            self.byte_offset,
            self.row_group_idx,
            self.page_idx,
            self.row_offset_in_page,
            self.global_row_idx,
        )

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> StreamCoordinate:
        """Parse exactly 32 bytes; anything else is a CorruptionError naming the length."""
        if len(data) != COORD_SIZE:
            raise CorruptionError(
                f"stream coordinate must be exactly {COORD_SIZE} bytes, got {len(data)}"
            )
        return cls(*_COORD.unpack(bytes(data)))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
