"""PageMap arithmetic: the upstream vectors, the build and parse rules, hostile input, properties."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core import pagemap as pm
from faultfs.core.pagemap import (
    EMPTY_PAGEMAP,
    MAX_PAGE_SIZE,
    MAX_PAGEMAP_LINES,
    MAX_PAGEMAP_TEXT,
    PageExtent,
    PageMap,
    PageRef,
    PageSlice,
    build,
    identity,
    parse,
    parse_strict,
)
from faultfs.errors import InvalidInput

E = PageExtent
GOLDEN = "pagemap\npage_size=1024\ntotal=1536\na 0 0 400\nd 16 1024 512\n"


# --- the vectors (page size 1024) -------------------------------------------------


def test_vector_page_composed_of_three_blobs_then_one():
    m = build(
        1024, [E("a", 0, 0, 400), E("b", 0, 400, 400), E("c", 0, 800, 224), E("d", 0, 1024, 512)]
    )
    assert m.num_pages == 2
    assert m.to_page(0) == [
        PageSlice("a", 0, 0, 400),
        PageSlice("b", 0, 400, 400),
        PageSlice("c", 0, 800, 224),
    ]
    assert m.to_page(1) == [PageSlice("d", 0, 0, 512)]


def test_vector_one_blob_across_three_pages():
    m = build(1024, [E("big", 0, 512, 2560)])
    assert m.num_pages == 3
    assert m.to_page(0) == [PageSlice("big", 0, 512, 512)]
    assert m.to_page(1) == [PageSlice("big", 512, 0, 1024)]
    assert m.to_page(2) == [PageSlice("big", 1536, 0, 1024)]
    assert m.to_page(3) == []


def test_vector_golden_serialization_and_back():
    m = build(1024, [E("a", 0, 0, 400), E("d", 16, 1024, 512)])
    assert m.serialize() == GOLDEN, "format changed: update docs/FORMAT-pagemap.md"
    assert parse(GOLDEN) == m
    assert parse_strict(GOLDEN) == m


# --- build rules ---------------------------------------------------------------------------


def test_build_page_size_zero_becomes_one():
    m = build(0, [E("a", 0, 0, 3)])
    assert m.page_size == 1
    assert m.num_pages == 3
    assert m.to_page(2) == [PageSlice("a", 2, 0, 1)]


def test_build_sorts_stably_and_first_writer_wins():
    m = build(100, [E("late", 0, 50, 10), E("first", 0, 0, 10), E("second", 0, 0, 20)])
    assert [e.blob_name for e in m.extents] == ["first", "late"]


def test_build_drops_overlap_whole_never_trims():
    m = build(100, [E("a", 0, 0, 100), E("b", 0, 50, 100), E("c", 0, 100, 10)])
    assert m.extents == (E("a", 0, 0, 100), E("c", 0, 100, 10))
    assert m.total == 110


def test_build_skips_size_zero_without_moving_end():
    m = build(10, [E("z", 0, 0, 0), E("a", 0, 0, 5), E("z2", 0, 7, 0), E("b", 0, 5, 1)])
    assert m.extents == (E("a", 0, 0, 5), E("b", 0, 5, 1))


def test_gaps_are_legal_and_total_is_last_end():
    m = build(10, [E("a", 0, 0, 3), E("b", 4, 25, 5)])
    assert m.total == 30
    assert m.num_pages == 3
    assert m.to_page(1) == []  # a gap page: no slices, reads as zeros
    assert m.to_page(2) == [PageSlice("b", 4, 5, 5)]


def test_empty_and_absent_maps():
    assert EMPTY_PAGEMAP.empty
    assert EMPTY_PAGEMAP.num_pages == 0
    assert EMPTY_PAGEMAP.to_page(0) == []
    assert EMPTY_PAGEMAP.from_page("a", 0, 10) == []
    m = build(4096, [])
    assert not m.empty
    assert (m.total, m.num_pages, m.to_page(0)) == (0, 0, [])


def test_to_page_negative_and_far_past_end():
    m = build(1024, [E("a", 0, 0, 10)])
    assert m.to_page(-1) == []
    assert m.to_page(2**70) == []


def test_pagemap_constructor_checks_invariants():
    with pytest.raises(InvalidInput):
        PageMap(10, (E("a", 0, 5, 10), E("b", 0, 0, 1)))
    with pytest.raises(InvalidInput):
        PageMap(0, (E("a", 0, 0, 1),))


@pytest.mark.parametrize(
    "extent",
    [
        E("a/b", 0, 0, 1),
        E("a\0", 0, 0, 1),
        E("", 0, 0, 1),
        E("a b", 0, 0, 1),
        E("page:3", 0, 0, 1),
        E("..", 0, 0, 1),
        E("x" * 256, 0, 0, 1),
        E("a", -1, 0, 1),
        E("a", 0, 2**63, 1),
        E("a", 0, 0, -1),
    ],
)
def test_build_refuses_values_a_pagemap_cannot_hold(extent):
    with pytest.raises(InvalidInput):
        build(1024, [extent])


def test_build_refuses_hostile_page_sizes():
    build(MAX_PAGE_SIZE, [])
    for ps in (MAX_PAGE_SIZE + 1, -1, 2**63):
        with pytest.raises(InvalidInput):
            build(ps, [])


def test_build_consumes_an_endless_iterable_boundedly(monkeypatch):
    monkeypatch.setattr(pm, "MAX_PAGEMAP_EXTENTS", 10)

    def endless():
        i = 0
        while True:
            yield E("a", 0, i, 1)
            i += 1

    with pytest.raises(InvalidInput, match="more than 10 extents"):
        build(1, endless())


# --- from_page -------------------------------------------------------------------------------


def test_from_page_splits_at_page_boundaries():
    m = build(1024, [E("big", 0, 512, 2560)])
    assert m.from_page("big", 0, 2560) == [
        PageRef(0, 512, 0, 512),
        PageRef(1, 0, 512, 1024),
        PageRef(2, 0, 1536, 1024),
    ]
    assert m.from_page("big", 500, 100) == [PageRef(0, 1012, 500, 12), PageRef(1, 0, 512, 88)]
    assert m.from_page("big", 3000, 10) == []
    assert m.from_page("other", 0, 10) == []
    assert m.from_page("big", 0, 0) == []


def test_from_page_finds_every_place_a_blob_byte_is_mapped():
    m = build(10, [E("a", 0, 0, 4), E("a", 0, 20, 4)])
    assert m.from_page("a", 1, 2) == [PageRef(0, 1, 1, 2), PageRef(2, 1, 1, 2)]


def test_from_page_caps_materialised_refs_but_iterates_lazily():
    m = build(1, [E("a", 0, 0, 2**40)])
    with pytest.raises(InvalidInput, match="spans more than"):
        m.from_page("a", 0, 2**40)
    first = []
    for ref in m.iter_from_page("a", 0, 2**40):
        first.append(ref)
        if len(first) == 3:
            break
    assert first == [PageRef(0, 0, 0, 1), PageRef(1, 0, 1, 1), PageRef(2, 0, 2, 1)]


# --- parse -----------------------------------------------------------------------------------


def test_parse_ignores_blank_header_and_total_lines_and_recomputes_total():
    text = "\n\npagemap\ntotal=999999\npage_size=1024\n\na 0 0 400\ntotal=1\nd 16 1024 512\n"
    assert parse(text) == parse(GOLDEN)
    assert parse(text).total == 1536


def test_parse_page_size_last_wins():
    assert parse("page_size=1\npage_size=1024\na 0 0 400\nd 16 1024 512").serialize() == GOLDEN
    assert parse("page_size=1024\npage_size=0\na 0 0 1\n") == EMPTY_PAGEMAP


def test_parse_ignores_extra_tokens_and_skips_non_extent_lines():
    text = "page_size=1024\na 0 0 400 extra tokens here\nnot an extent\nb x 1 2\nd 16 1024 512\n"
    assert parse(text) == parse(GOLDEN)
    with pytest.raises(InvalidInput, match="line 3"):
        parse_strict(text)


def test_parse_accepts_crlf():
    assert parse(GOLDEN.replace("\n", "\r\n")) == parse(GOLDEN)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "pagemap\n",
        "a 0 0 10\n",
        "page_size=0\na 0 0 1\n",
        "page_size=abc\na 0 0 1\n",
        "page_size=\n",
        "garbage",
    ],
)
def test_parse_malformed_gives_the_empty_map(text):
    assert parse(text) == EMPTY_PAGEMAP
    with pytest.raises(InvalidInput):
        parse_strict(text)


HOSTILE = {
    "huge number": "page_size=1024\na 0 0 100000000000000000000000000000\n",
    "2**63": f"page_size=1024\na {2**63} 0 1\n",
    "4301 digits": "page_size=1024\na 0 0 " + "9" * 4301 + "\n",
    "negative size": "page_size=1024\na 0 0 -5\n",
    "negative offset": "page_size=1024\na -0 0 5\n",
    "negative page size": "page_size=-1024\na 0 0 5\n",
    "page size over 1 GiB": f"page_size={MAX_PAGE_SIZE + 1}\na 0 0 5\n",
    "slash in name": "page_size=1024\n../etc/passwd 0 0 5\n",
    "NUL in name": "page_size=1024\na\0b 0 0 5\n",
    "page name": "page_size=1024\npage:0 0 0 1024\n",
    "long name": "page_size=1024\n" + "n" * 300 + " 0 0 5\n",
    "huge name with slash": "page_size=1024\n" + "n" * 100_000 + "/ 0 0 5\n",
    "lone surrogate": "page_size=1024\na\ud800 0 0 5\n",
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_parse_refuses_hostile_values(name):
    text = HOSTILE[name]
    assert parse(text) == EMPTY_PAGEMAP
    with pytest.raises(InvalidInput) as info:
        parse_strict(text)
    assert "\n" not in str(info.value), "reasons are one line"
    assert len(str(info.value)) < 120, "reasons stay short whatever the input"


def test_parse_limits_are_inclusive():
    m = parse(f"page_size={MAX_PAGE_SIZE}\na {2**63 - 1} {2**63 - 1} {2**63 - 1}\n")
    assert m.page_size == MAX_PAGE_SIZE
    assert m.total == 2 * (2**63 - 1)
    assert m.num_pages == -(-m.total // MAX_PAGE_SIZE)
    assert parse(m.serialize()) == m


def test_parse_leading_zeros_do_not_count_as_size():
    m = parse("page_size=0001024\na 0000000000000000000000000 000000000000000000000000000001 3\n")
    assert m == build(1024, [E("a", 0, 1, 3)])


def test_parse_a_million_lines_is_bounded():
    started = time.monotonic()
    assert parse("page_size=1024\n" + "\n" * 1_000_000).total == 0  # blank lines: fine
    too_many = "page_size=1024\n" + "a 0 0 1\n" * MAX_PAGEMAP_LINES
    assert parse(too_many) == EMPTY_PAGEMAP  # refused by a count before any split
    with pytest.raises(InvalidInput, match="lines"):
        parse_strict(too_many)
    too_long = "page_size=1024\n" + "x" * MAX_PAGEMAP_TEXT
    assert parse(too_long) == EMPTY_PAGEMAP
    assert time.monotonic() - started < 5


def test_parse_refuses_more_extents_than_the_cap(monkeypatch):
    monkeypatch.setattr(pm, "MAX_PAGEMAP_EXTENTS", 3)
    assert parse("page_size=8\n" + "".join(f"a 0 {i} 1\n" for i in range(3))).total == 3
    text = "page_size=8\n" + "".join(f"a 0 {i} 1\n" for i in range(4))
    assert parse(text) == EMPTY_PAGEMAP
    with pytest.raises(InvalidInput, match="more than 3 extents"):
        parse_strict(text)


def test_parse_strict_agrees_with_parse_on_good_maps():
    text = "pagemap\npage_size=1024\ntotal=0\na 0 0 400 checksum=abc\nb 0 0 10\n"
    assert parse_strict(text) == parse(text) == build(1024, [E("a", 0, 0, 400)])


# --- identity --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("page_size", "total", "chunk_size"),
    [
        (1024, 4096, 1024),
        (1000, 2500, 1024),
        (4096, 10_000, 1000),
        (7, 100, 13),
        (1, 5, 2),
        (2 << 20, (5 << 20) + 3, 1 << 20),
        (1 << 20, 3 << 20, 4 << 20),
    ],
)
def test_identity_page_n_is_bytes_n_times_ps_of_the_range(page_size, total, chunk_size):
    m = identity(page_size, total, chunk_size, "chunk_")
    assert m.total == total
    assert m.num_pages == -(-total // page_size)
    for page_id in (0, 1, m.num_pages // 2, m.num_pages - 1, m.num_pages):
        lo = page_id * page_size
        expect = max(0, min(page_size, total - lo))
        got = 0
        for s in m.to_page(page_id):
            chunk = int(s.blob_name.removeprefix("chunk_"))
            assert chunk * chunk_size + s.blob_off == lo + s.dst_off
            assert s.blob_off + s.size <= chunk_size
            got += s.size
        assert got == expect


def test_identity_names_and_last_chunk():
    m = identity(1024, 2500, 1024, "")
    assert m.extents == (E("0", 0, 0, 1024), E("1", 0, 1024, 1024), E("2", 0, 2048, 452))
    assert identity(1024, 0, 1024, "chunk_").num_pages == 0


def test_identity_refusals():
    with pytest.raises(InvalidInput, match="chunk size"):
        identity(1024, 10, 0, "chunk_")
    with pytest.raises(InvalidInput, match="larger chunk size"):
        identity(1024, 2**62, 1, "chunk_")
    with pytest.raises(InvalidInput):
        identity(1024, 10, 4, "bad/")


def test_to_page_on_a_large_map_uses_bisect():
    m = identity(4096, 200_000 * 4096, 4096, "c")
    started = time.monotonic()
    for page_id in range(0, 200_000, 97):
        assert m.to_page(page_id) == [PageSlice(f"c{page_id}", 0, 0, 4096)]
    assert time.monotonic() - started < 2  # a linear scan would take minutes


# --- properties ------------------------------------------------------------------------------

names = st.sampled_from(["a", "b", "c", "chunk_0", "0"])
extents = st.lists(
    st.builds(E, names, st.integers(0, 40), st.integers(0, 120), st.integers(0, 40)),
    max_size=12,
)
page_sizes = st.integers(0, 50)


def model_build(extent_list):
    kept, end = [], 0
    for e in sorted(extent_list, key=lambda e: e.page_off):
        if e.size and e.page_off >= end:
            kept.append(e)
            end = e.page_off + e.size
    return kept


def byte_map_from_pages(m):
    """{page-space byte: (blob, blob byte)} from to_page over every page."""
    out = {}
    for page_id in range(m.num_pages + 1):
        for s in m.to_page(page_id):
            for k in range(s.size):
                key = page_id * m.page_size + s.dst_off + k
                assert key not in out, "a page byte maps to two blob bytes"
                out[key] = (s.blob_name, s.blob_off + k)
    return out


@settings(max_examples=200, deadline=None)
@given(page_sizes, extents)
def test_build_matches_first_writer_wins_model(page_size, extent_list):
    m = build(page_size, extent_list)
    assert list(m.extents) == model_build(extent_list)
    assert m.page_size == (page_size or 1)


@settings(max_examples=200, deadline=None)
@given(page_sizes, extents)
def test_every_page_byte_maps_to_at_most_one_blob_byte(page_size, extent_list):
    m = build(page_size, extent_list)
    for page_id in range(m.num_pages + 1):
        end = 0
        for s in m.to_page(page_id):
            assert s.size > 0
            assert end <= s.dst_off < s.dst_off + s.size <= m.page_size
            end = s.dst_off + s.size
    expected = {}
    for e in m.extents:
        for k in range(e.size):
            expected[e.page_off + k] = (e.blob_name, e.blob_off + k)
    assert byte_map_from_pages(m) == expected


@settings(max_examples=200, deadline=None)
@given(page_sizes, extents, names, st.integers(0, 50), st.integers(0, 50))
def test_to_page_and_from_page_are_inverse(page_size, extent_list, blob, off, size):
    m = build(page_size, extent_list)
    page_bytes = byte_map_from_pages(m)
    # from_page -> to_page: every ref lands on exactly those blob bytes.
    for ref in m.from_page(blob, off, size):
        assert 0 <= ref.dst_off < ref.dst_off + ref.size <= m.page_size
        for k in range(ref.size):
            assert page_bytes[ref.page_id * m.page_size + ref.dst_off + k] == (
                blob,
                ref.blob_off + k,
            )
    # to_page -> from_page: every page byte of this blob in range is found.
    found = {
        ref.page_id * m.page_size + ref.dst_off + k
        for ref in m.from_page(blob, off, size)
        for k in range(ref.size)
    }
    wanted = {p for p, (b, bo) in page_bytes.items() if b == blob and off <= bo < off + size}
    assert found == wanted


@settings(max_examples=200, deadline=None)
@given(page_sizes, extents)
def test_parse_serialize_roundtrip(page_size, extent_list):
    m = build(page_size, extent_list)
    assert parse(m.serialize()) == m
    assert parse_strict(m.serialize()) == m


line_parts = st.sampled_from(
    [
        "pagemap",
        "page_size=",
        "total=",
        "a",
        "b/c",
        "-",
        "0",
        "7",
        "1024",
        "-3",
        str(2**63),
        str(2**63 - 1),
        "x",
        " ",
        "\t",
        "\r",
        "\0",
        "page:1",
        "99999999999999999999",
    ]
)
near_valid = st.lists(st.lists(line_parts, max_size=6).map(" ".join), max_size=20).map("\n".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=400), near_valid))
def test_parse_never_raises_and_strict_agrees(text):
    m = parse(text)
    assert isinstance(m, PageMap)
    assert m.empty or 0 < m.page_size <= MAX_PAGE_SIZE
    assert len(m.extents) <= text.count("\n") + 1
    try:
        strict, reason = parse_strict(text), ""
    except InvalidInput as err:
        strict, reason = None, str(err)
    assert "\n" not in reason
    assert strict is None or strict == m


@settings(max_examples=200, deadline=None)
@given(ps=st.integers(1, 64), raw=st.lists(st.tuples(st.integers(0, 300), st.integers(1, 80)),
                                           max_size=30))
def test_max_slices_per_page_matches_counting_every_page(ps, raw):
    from faultfs.core.pagemap import max_slices_per_page

    pm = build(ps, [PageExtent("b", 0, off, size) for off, size in raw])
    want = max((len(pm.to_page(p)) for p in range(pm.num_pages)), default=0)
    got, page = max_slices_per_page(pm)
    assert got == want
    if want:
        assert len(pm.to_page(page)) == want
