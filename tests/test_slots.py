"""DiskSlot codec: golden bytes, CRC coverage, and every reason a slot is not valid."""

import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faultfs.core.coord import StreamCoordinate
from faultfs.core.slots import (
    SLOT_A_OFFSET,
    SLOT_B_OFFSET,
    SLOT_SIZE,
    DiskSlot,
    SlotStatus,
    decode_slot,
    slot_offset_for_epoch,
)
from faultfs.errors import InvalidInput

COORD = StreamCoordinate(3, 0x1122334455667788, 7, 2, 9, 123456789)
GOLDEN = DiskSlot(epoch=5, committed_batch_id=42, coord=COORD, dedup_count=1000)
GOLDEN_HEX = (
    "4c4d444c"  # magic b"LMDL"
    "01000000"  # version 1
    "0500000000000000"  # epoch
    "2a00000000000000"  # committed_batch_id
    "03000000887766554433221107000000020000000900000015cd5b0700000000"  # coord
    "e8030000"  # dedup_count
    "5d5a6a8f"  # crc32 over bytes 0..60
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
coords = st.builds(StreamCoordinate, u32, u64, u32, u32, u32, u64)
slots = st.builds(DiskSlot, u64, u64, coords, u32)


def test_golden_bytes():
    assert GOLDEN.encode().hex() == GOLDEN_HEX, "format changed: bump the version"
    reading = decode_slot(bytes.fromhex(GOLDEN_HEX))
    assert reading.valid
    assert reading.slot == GOLDEN


def test_crc_is_ieee_crc32_over_first_60_bytes():
    raw = GOLDEN.encode()
    assert len(raw) == SLOT_SIZE
    assert struct.unpack_from("<I", raw, 60)[0] == zlib.crc32(raw[:60])
    # IEEE CRC-32 check value: crc32(b"123456789") == 0xCBF43926
    assert zlib.crc32(b"123456789") == 0xCBF43926


@given(slots)
def test_round_trip(slot):
    reading = decode_slot(slot.encode())
    assert reading.status is SlotStatus.VALID
    assert reading.slot == slot


@given(slots, st.integers(0, 63), st.integers(1, 255))
def test_any_single_byte_change_is_detected(slot, pos, flip):
    raw = bytearray(slot.encode())
    raw[pos] ^= flip
    reading = decode_slot(bytes(raw))
    assert not reading.valid
    assert reading.slot is None


def test_all_zero():
    reading = decode_slot(bytes(64))
    assert reading.status is SlotStatus.ALL_ZERO
    assert reading.describe() == "all-zero"


def test_bad_magic():
    raw = b"XXXX" + GOLDEN.encode()[4:]
    reading = decode_slot(raw)
    assert reading.status is SlotStatus.BAD_MAGIC
    assert "bad magic" in reading.describe()


def test_bad_version_is_reported_before_crc():
    raw = bytearray(GOLDEN.encode())
    raw[4:8] = struct.pack("<I", 2)
    raw[60:64] = struct.pack("<I", zlib.crc32(bytes(raw[:60])))
    assert decode_slot(bytes(raw)).status is SlotStatus.BAD_VERSION
    raw[4:8] = struct.pack("<I", 7)  # crc now also wrong: version still named first
    assert decode_slot(bytes(raw)).describe() == "bad version: 7 != 1"


def test_bad_crc():
    raw = bytearray(GOLDEN.encode())
    raw[40] ^= 1
    reading = decode_slot(bytes(raw))
    assert reading.status is SlotStatus.BAD_CRC
    assert reading.describe().startswith("bad crc: stored 8f6a5a5d")


def test_torn_slot_prefix_is_bad_crc():
    new = DiskSlot(7, 43, COORD, 1001).encode()
    for cut in range(8, 64):
        torn = new[:cut] + bytes(64 - cut)
        assert not decode_slot(torn).valid


@pytest.mark.parametrize("length", [0, 63, 65, 128])
def test_bad_length(length):
    reading = decode_slot(bytes(length))
    assert reading.status is SlotStatus.BAD_LENGTH
    assert f"got {length}" in reading.describe()


def test_corrupted_dedup_count_fails_crc():
    raw = bytearray(GOLDEN.encode())
    raw[56:60] = struct.pack("<I", 2**32 - 1)
    assert decode_slot(bytes(raw)).status is SlotStatus.BAD_CRC


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"epoch": 2**64}, "epoch"),
        ({"committed_batch_id": -1}, "committed_batch_id"),
        ({"dedup_count": 2**32}, "dedup_count"),
    ],
)
def test_out_of_range_fields_are_refused(kwargs, match):
    args = {"epoch": 1, "committed_batch_id": 0, "coord": COORD, "dedup_count": 0} | kwargs
    with pytest.raises(InvalidInput, match=match):
        DiskSlot(**args)


def test_epoch_parity_picks_the_slot():
    assert slot_offset_for_epoch(1) == SLOT_A_OFFSET == 0
    assert slot_offset_for_epoch(2) == SLOT_B_OFFSET == 64
    assert slot_offset_for_epoch(3) == 0
    assert DiskSlot(10, 0, COORD, 0).offset == 64
