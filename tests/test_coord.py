"""StreamCoordinate: golden bytes, round trip, range checks, decode errors."""

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faultfs.core.coord import COORD_SIZE, StreamCoordinate
from faultfs.errors import CorruptionError, FaultfsError, InvalidInput

GOLDEN = StreamCoordinate(3, 0x1122334455667788, 7, 2, 9, 123456789)
GOLDEN_HEX = "03000000887766554433221107000000020000000900000015cd5b0700000000"

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
coords = st.builds(StreamCoordinate, u32, u64, u32, u32, u32, u64)


def test_golden_bytes():
    assert GOLDEN.encode().hex() == GOLDEN_HEX, "format changed: bump the version"
    assert StreamCoordinate.decode(bytes.fromhex(GOLDEN_HEX)) == GOLDEN


def test_field_offsets_match_design():
    # shard_id u32 @0, byte_offset u64 @4, row_group_idx u32 @12, page_idx u32 @16,
    # row_offset_in_page u32 @20, global_row_idx u64 @24
    raw = GOLDEN.encode()
    assert len(raw) == COORD_SIZE == 32
    assert struct.unpack_from("<I", raw, 0)[0] == 3
    assert struct.unpack_from("<Q", raw, 4)[0] == 0x1122334455667788
    assert struct.unpack_from("<I", raw, 12)[0] == 7
    assert struct.unpack_from("<I", raw, 16)[0] == 2
    assert struct.unpack_from("<I", raw, 20)[0] == 9
    assert struct.unpack_from("<Q", raw, 24)[0] == 123456789


def test_default_is_the_start():
    assert StreamCoordinate().encode() == bytes(32)


@given(coords)
def test_round_trip(c):
    raw = c.encode()
    assert len(raw) == 32
    assert StreamCoordinate.decode(raw) == c
    assert StreamCoordinate.decode(bytearray(raw)) == c
    assert StreamCoordinate.decode(memoryview(raw)) == c


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("shard_id", 2**32),
        ("shard_id", -1),
        ("byte_offset", 2**64),
        ("row_group_idx", 2**32),
        ("page_idx", 2**32),
        ("row_offset_in_page", 2**32),
        ("global_row_idx", 2**64),
        ("global_row_idx", -1),
    ],
)
def test_out_of_range_fields_are_refused(field, bad):
    with pytest.raises(InvalidInput, match=f"{field}={bad} out of range"):
        StreamCoordinate(**{field: bad})


@pytest.mark.parametrize("bad", [1.0, "3", True, None])
def test_non_int_fields_are_refused(bad):
    with pytest.raises(InvalidInput, match="must be an int"):
        StreamCoordinate(shard_id=bad)


@pytest.mark.parametrize("length", [0, 31, 33, 64])
def test_decode_wrong_length_is_a_clear_error(length):
    with pytest.raises(CorruptionError, match=f"exactly 32 bytes, got {length}"):
        StreamCoordinate.decode(bytes(length))


def test_errors_carry_errno():
    with pytest.raises(FaultfsError) as info:
        StreamCoordinate.decode(b"")
    assert info.value.errno != 0


def test_frozen():
    with pytest.raises(AttributeError):
        GOLDEN.shard_id = 4  # type: ignore[misc]


def test_an_int_subclass_in_range_is_a_field():
    """The fast check takes plain ints; an int subclass (an IntEnum, say) in range passes
    the full one, as before it."""
    import enum

    class Shard(enum.IntEnum):
        SECOND = 1

    c = StreamCoordinate(shard_id=Shard.SECOND, byte_offset=7)
    assert c.shard_id == 1 and StreamCoordinate.decode(c.encode()) == StreamCoordinate(1, 7)
