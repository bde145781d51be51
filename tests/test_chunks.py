"""Chunk arithmetic: blob index <-> source range, zero tails, view pieces."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from faultfs.core.chunks import ChunkLayout, zero_fill
from faultfs.errors import InvalidInput

MiB = 1 << 20


def test_upstream_example_chunk_7_of_a_4mib_context():
    layout = ChunkLayout(0, 64 * MiB, 4 * MiB, "")
    assert layout.blob_index("7") == 7
    assert layout.source_range(7) == (28 * MiB, 32 * MiB)


def test_short_final_blob_and_range_offset():
    layout = ChunkLayout(100, 100 + 2500, 1000)
    assert layout.num_blobs == 3
    assert layout.source_range(0) == (100, 1100)
    assert layout.source_range(2) == (2100, 2600)
    assert zero_fill(b"ab", 5) == b"ab\0\0\0"


def test_blob_names_only_in_canonical_decimal_form():
    layout = ChunkLayout(0, 10 * MiB, MiB)
    assert layout.blob_index("chunk_0") == 0
    assert layout.blob_index("chunk_9") == 9
    for bad in ("chunk_10", "chunk_07", "chunk_", "chunk_-1", "chunk_1.0", "chunk_١", "page:0", "x"):
        assert layout.blob_index(bad) is None, bad


def test_empty_source_has_no_blobs():
    layout = ChunkLayout(0, 0, MiB)
    assert layout.num_blobs == 0
    assert layout.view_pieces(0, 100) == []


@pytest.mark.parametrize("kwargs", [
    {"range_off": 0, "range_end": 10, "chunk_size": 0},
    {"range_off": 0, "range_end": 10, "chunk_size": (1 << 30) + 1},
    {"range_off": 10, "range_end": 5, "chunk_size": 1},
])
def test_invalid_layouts(kwargs):
    with pytest.raises(InvalidInput):
        ChunkLayout(**kwargs)


@given(r0=st.integers(0, 10_000), size=st.integers(0, 50_000), cs=st.integers(1, 5000),
       off=st.integers(0, 60_000), n=st.integers(0, 20_000))
def test_view_pieces_tile_the_request_exactly(r0, size, cs, off, n):
    layout = ChunkLayout(r0, r0 + size, cs)
    pieces = layout.view_pieces(off, n)
    expect = max(0, min(off + n, size) - off)
    assert sum(length for _, _, length in pieces) == expect
    pos = off
    for index, inner, length in pieces:
        assert index * cs + inner == pos
        assert 0 < length <= cs - inner
        start, end = layout.source_range(index)
        assert start + inner + length <= end
        pos += length


@given(r0=st.integers(0, 10_000), size=st.integers(1, 50_000), cs=st.integers(1, 5000))
def test_blobs_partition_the_range(r0, size, cs):
    layout = ChunkLayout(r0, r0 + size, cs)
    pos = r0
    for i in range(layout.num_blobs):
        start, end = layout.source_range(i)
        assert start == pos and 0 < end - start <= cs
        assert layout.blob_index(layout.blob_name(i)) == i
        pos = end
    assert pos == r0 + size
