"""ExtentMap against a bytearray model: writes, zeros and cuts over a base, in any order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from faultfs.core.extents import ExtentMap

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
