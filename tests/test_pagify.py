"""Pagify over a dict-of-bytes blob store: assembly, zeros, gaps, short reads, writes, windows."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core.pagemap import EMPTY_PAGEMAP, PageExtent, PageSlice, build, identity
from faultfs.core.pagify import (
    PageIoResult,
    assemble,
    plan_page,
    read_page,
    tally,
    window_size,
    write_page,
)
from faultfs.errors import InvalidInput, SourceError

E = PageExtent


def pattern(seed: int, n: int) -> bytes:
    return bytes((seed * 31 + i * 7) % 251 + 1 for i in range(n))  # never zero


class FakeBlobs:
    """A blob store of named byte strings that records calls and can be told to fail."""

    def __init__(self, blobs: dict[str, bytes]) -> None:
        self.blobs = {k: bytearray(v) for k, v in blobs.items()}
        self.reads: list[tuple[str, int, int]] = []
        self.writes: list[tuple[str, int, bytes]] = []
        self.short = set()  # names whose reads/writes return one byte short

    def read(self, name: str, blob_off: int, size: int, view: memoryview) -> int:
        self.reads.append((name, blob_off, size))
        if name not in self.blobs:
            raise SourceError(f"{name}: no such blob")
        data = self.blobs[name][blob_off : blob_off + size]
        if name in self.short:
            data = data[:-1]
        view[: len(data)] = data
        return len(data)

    def write(self, name: str, blob_off: int, data: memoryview) -> int:
        self.writes.append((name, blob_off, bytes(data)))
        n = len(data) - (1 if name in self.short else 0)
        blob = self.blobs.setdefault(name, bytearray())
        if len(blob) < blob_off + n:
            blob.extend(bytes(blob_off + n - len(blob)))
        blob[blob_off : blob_off + n] = data[:n]
        return n


def upstream_e2e_map():
    """Like upstream test_cae_pagify: page 0 from three blobs, page 1 = 1000 bytes at 500."""
    m = build(
        2048,
        [E("a", 0, 0, 700), E("b", 0, 700, 700), E("c", 0, 1400, 648), E("d", 0, 2048 + 500, 1000)],
    )
    store = FakeBlobs({n: pattern(i, 1000) for i, n in enumerate("abcd")})
    return m, store


def test_page_composed_of_several_blobs():
    m, store = upstream_e2e_map()
    dst = bytearray(b"\xff" * 2048)
    res = read_page(m, 0, dst, store.read)
    assert res == PageIoResult(ok=True, slices=3, bytes=2048, zero_filled=0)
    assert dst == store.blobs["a"][:700] + store.blobs["b"][:700] + store.blobs["c"][:648]


def test_blob_covering_part_of_a_page_has_zeros_around_it():
    m, store = upstream_e2e_map()
    dst = bytearray(b"\xff" * 2048)  # garbage must be zeroed, not kept
    res = read_page(m, 1, dst, store.read)
    assert res == PageIoResult(ok=True, slices=1, bytes=1000, zero_filled=1048)
    assert dst == bytes(500) + store.blobs["d"] + bytes(548)


def test_gap_page_and_page_past_end_are_ok_and_zero():
    m = build(100, [E("a", 0, 0, 10), E("b", 0, 250, 10)])
    store = FakeBlobs({"a": pattern(1, 10), "b": pattern(2, 10)})
    for page_id in (1, 3, 10**9):  # page 1 is a gap, pages 3 and 10**9 are past the end
        dst = bytearray(b"\x01" * 100)
        assert read_page(m, page_id, dst, store.read) == PageIoResult(True, 0, 0, 100)
        assert dst == bytes(100)
    assert store.reads == []
    dst = bytearray(100)
    assert read_page(m, 2, dst, store.read) == PageIoResult(True, 1, 10, 90)
    assert dst == bytes(50) + store.blobs["b"] + bytes(40)


def test_short_read_fails_the_page_and_stops():
    m, store = upstream_e2e_map()
    store.short.add("b")
    res = read_page(m, 0, bytearray(2048), store.read)
    assert not res.ok
    assert res.slices == 3
    assert res.bytes == 700 + 699
    assert [r[0] for r in store.reads] == ["a", "b"], "no reads after the failed slice"


def test_missing_blob_error_propagates():
    m = build(10, [E("gone", 0, 0, 10)])
    with pytest.raises(SourceError):
        read_page(m, 0, bytearray(10), FakeBlobs({}).read)


def test_empty_map_fails_every_request():
    dst = bytearray(b"\x07" * 8)
    assert read_page(EMPTY_PAGEMAP, 0, dst, FakeBlobs({}).read) == PageIoResult(False, 0, 0, 0)
    assert dst == bytes(8)
    assert not write_page(EMPTY_PAGEMAP, 0, b"x", FakeBlobs({}).write).ok


def test_window_reads_part_of_a_page_and_zeroes_past_the_page_end():
    m, store = upstream_e2e_map()
    full = bytearray(2048)
    read_page(m, 1, full, store.read)
    dst = bytearray(b"\xff" * 600)
    res = read_page(m, 1, dst, store.read, offset=1800)
    assert res == PageIoResult(True, 0, 0, 248)
    assert dst == bytes(600)
    dst = bytearray(b"\xff" * 100)
    assert read_page(m, 1, dst, store.read, offset=450).bytes == 50
    assert dst == full[450:550]


def test_plan_page_clips_to_the_window():
    m = build(1024, [E("a", 0, 0, 400), E("b", 0, 400, 400), E("c", 0, 800, 224)])
    assert plan_page(m, 0, 300, 200) == [PageSlice("a", 300, 0, 100), PageSlice("b", 0, 100, 100)]
    assert plan_page(m, 0, 1024) == []
    assert plan_page(m, 0) == m.to_page(0)
    assert window_size(m, 1000, 100) == 24
    with pytest.raises(InvalidInput):
        plan_page(m, 0, -1)


def test_write_page_writes_mapped_slices_only_and_skips_gaps():
    m = build(100, [E("a", 10, 0, 30), E("b", 0, 60, 20)])
    store = FakeBlobs({})
    src = pattern(9, 100)
    res = write_page(m, 0, src, store.write)
    assert res == PageIoResult(ok=True, slices=2, bytes=50, zero_filled=50)
    assert store.writes == [("a", 10, src[0:30]), ("b", 0, src[60:80])]
    back = bytearray(100)
    assert read_page(m, 0, back, store.read).ok
    assert back == src[0:30] + bytes(30) + src[60:80] + bytes(20)


def test_short_write_fails_the_page():
    m = build(100, [E("a", 0, 0, 30), E("b", 0, 60, 20)])
    store = FakeBlobs({})
    store.short.add("a")
    res = write_page(m, 0, bytes(100), store.write)
    assert not res.ok
    assert [w[0] for w in store.writes] == ["a"]


def test_assemble_matches_read_page_and_fails_on_missing_or_short_pieces():
    m, store = upstream_e2e_map()
    slices = plan_page(m, 0)
    pieces = [bytes(store.blobs[s.blob_name][s.blob_off : s.blob_off + s.size]) for s in slices]
    dst = bytearray(b"\xff" * 2048)
    expect = bytearray(2048)
    assert assemble(dst, slices, pieces) == read_page(m, 0, expect, store.read)
    assert dst == expect
    assert not assemble(bytearray(2048), slices, [pieces[0], None, pieces[2]]).ok
    assert not assemble(bytearray(2048), slices, [pieces[0], pieces[1][:-1], pieces[2]]).ok
    with pytest.raises(InvalidInput):
        assemble(bytearray(2048), slices, pieces[:1])


def test_tally_for_engines_that_read_into_place():
    slices = [PageSlice("a", 0, 0, 10), PageSlice("b", 0, 20, 5)]
    assert tally(slices, [10, 5], 32) == PageIoResult(True, 2, 15, 17)
    assert tally(slices, [10, 4], 32) == PageIoResult(False, 2, 14, 17)
    assert tally(slices, [10], 32) == PageIoResult(False, 2, 10, 17)


@pytest.mark.parametrize(
    ("page_size", "total", "chunk_size"),
    [(1024, 5000, 1024), (1000, 2500, 1024), (4096, 10_000, 1000), (7, 100, 13)],
)
def test_identity_pages_are_the_range_bytes_zero_padded(page_size, total, chunk_size):
    source = pattern(5, total)
    chunks = {
        f"chunk_{i}": source[i * chunk_size : (i + 1) * chunk_size].ljust(chunk_size, b"\0")
        for i in range(-(-total // chunk_size))
    }
    store = FakeBlobs(chunks)
    m = identity(page_size, total, chunk_size, "chunk_")
    for page_id in range(m.num_pages + 1):
        dst = bytearray(page_size)
        assert read_page(m, page_id, dst, store.read).ok
        want = source[page_id * page_size : (page_id + 1) * page_size]
        assert dst == want.ljust(page_size, b"\0")


@st.composite
def paged_stores(draw):
    names = ["a", "b", "c"]
    blobs = {n: pattern(i + 1, draw(st.integers(0, 60))) for i, n in enumerate(names)}
    extent_list = draw(
        st.lists(
            st.builds(
                E,
                st.sampled_from(names),
                st.integers(0, 30),
                st.integers(0, 150),
                st.integers(0, 30),
            ),
            max_size=10,
        )
    )
    extent_list = [e for e in extent_list if e.blob_off + e.size <= len(blobs[e.blob_name])]
    return build(draw(st.integers(1, 40)), extent_list), blobs


@settings(max_examples=200, deadline=None)
@given(paged_stores(), st.integers(0, 6), st.integers(0, 45), st.integers(0, 45))
def test_read_page_window_matches_a_byte_model(map_and_blobs, page_id, offset, length):
    m, blobs = map_and_blobs
    space = bytearray(max(m.total, (page_id + 1) * m.page_size))
    for e in m.extents:
        space[e.page_off : e.page_off + e.size] = blobs[e.blob_name][
            e.blob_off : e.blob_off + e.size
        ]
    page = space[page_id * m.page_size : (page_id + 1) * m.page_size]
    dst = bytearray(b"\xee" * length)
    res = read_page(m, page_id, dst, FakeBlobs(blobs).read, offset=offset)
    assert res.ok
    assert dst == page[offset : offset + length].ljust(length, b"\0")
    window = window_size(m, offset, length)
    assert res.bytes + res.zero_filled == window
