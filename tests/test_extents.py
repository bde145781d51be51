"""ExtentMap against a bytearray model: writes, zeros and cuts over a base, in any order."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core.extents import ExtentMap, Ref, spilled

SIZE = 200
ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, SIZE), st.binary(min_size=1, max_size=60)),
    st.tuples(st.just("zero"), st.integers(0, SIZE), st.integers(1, 60)),
    st.tuples(st.just("cut"), st.integers(0, SIZE + 60), st.just(0)),
), max_size=40)


@settings(max_examples=400, deadline=None)
@given(ops, st.binary(min_size=SIZE + 60, max_size=SIZE + 60))
def test_extent_map_matches_a_bytearray(script, base):
    model = bytearray(base)
    covered = [False] * len(base)
    m = ExtentMap()
    for kind, off, arg in script:
        if kind == "write":
            m.write(off, arg)
            model[off:off + len(arg)] = arg
            for k in range(off, min(off + len(arg), len(base))):
                covered[k] = True
        elif kind == "zero":
            m.zero(off, arg)
            model[off:off + arg] = bytes(arg)
            for k in range(off, min(off + arg, len(base))):
                covered[k] = True
        else:
            m.cut(off)
            for k in range(off, len(base)):
                covered[k] = False
                model[k] = base[k]
        model = model[:len(base)]
    buf = bytearray(base)
    m.overlay(buf, 0)
    assert bytes(buf) == bytes(model)
    starts = [s for s, _, _ in m.items()]
    assert starts == sorted(starts)
    ends = [s + n for s, n, _ in m.items()]
    assert all(e <= s for e, s in zip(ends, starts[1:], strict=False)), "no overlaps"
    assert m.held == sum(n for _, n, d in m.items() if d is not None)
    for off in range(0, len(base), 37):  # windows see the same bytes
        window = bytearray(base[off:off + 50])
        m.overlay(window, off)
        assert bytes(window) == bytes(model[off:off + 50])
    for off in range(0, len(base), 13):  # and know whether any base byte shows in them
        for n in (0, 1, 9, 50):
            if off + n <= len(base):
                assert m.covers(off, n) == all(covered[off:off + n]), (off, n)


def test_zero_extents_hold_no_memory():
    m = ExtentMap()
    m.zero(0, 1 << 40)
    assert m.held == 0 and m.end == 1 << 40
    m.write(10, b"abc")
    assert m.held == 3 and len(m) == 3


spill_ops = st.lists(st.one_of(
    st.tuples(st.just("write"), st.integers(0, SIZE), st.binary(min_size=1, max_size=60)),
    st.tuples(st.just("zero"), st.integers(0, SIZE), st.integers(1, 60)),
    st.tuples(st.just("cut"), st.integers(0, SIZE + 60), st.just(0)),
    st.tuples(st.just("spill"), st.just(0), st.just(0)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(spill_ops, st.binary(min_size=SIZE + 60, max_size=SIZE + 60))
def test_refs_read_back_after_a_spill_match_a_bytearray(script, base):
    """Writes as refs into a 'file' of records, spilled at random: the same bytes as held
    writes, ``held`` counts only what is still in memory, and a spilled part is read back
    through the resolver (never from the map)."""
    records: list[bytes] = []
    model = bytearray(base)
    m = ExtentMap()
    for kind, off, arg in script:
        if kind == "write":
            records.append(bytes(arg))
            m.write(off, Ref(7, len(records) - 1, len(arg), 0, 0, len(arg), bytes(arg)))
            model[off:off + len(arg)] = arg
        elif kind == "zero":
            m.zero(off, arg)
            model[off:off + arg] = bytes(arg)
        elif kind == "cut":
            m.cut(off)
            model[off:] = base[off:]
        else:
            m.spill(1 << 20)
            assert m.held == 0
        model = model[:len(base)]
    read_back = []

    def resolve(ref: Ref) -> bytes:
        assert ref.file == 7 and ref.length == len(records[ref.pos])
        read_back.append(ref)
        return records[ref.pos][ref.lo:ref.hi]

    buf = bytearray(base)
    m.overlay(buf, 0, resolve)
    assert bytes(buf) == bytes(model)
    assert m.held == sum(n for _, n, d in m.items() if d is not None and not spilled(d))
    for off in range(0, len(base), 41):  # windows (a part of a ref is a ref) see the same
        window = bytearray(base[off:off + 50])
        m.overlay(window, off, resolve)
        assert bytes(window) == bytes(model[off:off + 50])
    if any(spilled(d) for _, _, d in m.items()):
        assert read_back, "spilled parts are read back"


def test_a_spilled_ref_needs_a_resolver_and_long_records_stay_held():
    m = ExtentMap()
    m.write(0, Ref(1, 0, 10, 0, 0, 10, b"0123456789"))
    m.write(100, Ref(1, 50, 5000, 0, 0, 5000, bytes(5000)))
    assert m.spill(4096) == 10 and m.held == 5000, "a record over the limit keeps its bytes"
    with pytest.raises(ValueError):
        m.overlay(bytearray(20), 0)
    buf = bytearray(20)
    m.overlay(buf, 0, lambda ref: b"0123456789"[ref.lo:ref.hi])
    assert bytes(buf[:10]) == b"0123456789"
