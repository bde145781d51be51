"""The cross-name case's model without a mount (``faultfs.testing.torture.crossname_model``):
the layout its writers share, the pagemap it lays, and the point-in-time check of a clone
against the writers' logs — that it accepts the tag at an instant and refuses what never was.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from faultfs.core.pagemap import parse_strict
from faultfs.core.pagify import read_page
from faultfs.testing.torture.crossname_model import (
    PARTS,
    UNIT,
    Layout,
    Model,
    Op,
    op_data,
    parse_parts,
    share,
    user_initial_bytes,
    writer_specs,
)

LAYOUT = Layout()


def test_the_writers_own_disjoint_bytes_and_share_kernel_pages():
    specs = writer_specs(LAYOUT, PARTS)
    model = Model(LAYOUT, specs, bytes(LAYOUT.source_size), bytes(LAYOUT.user_initial))
    # every pair's two writers have bytes in one 4 KiB page
    for part in ("view-chunk", "mmap-chunk", "page-chunk", "view-page", "user-page"):
        a, b = (s for s in specs if s.part == part)
        lo = a.slots[0][0]
        owners = set(model.owner[a.space][lo:lo + UNIT].tolist())
        assert owners == {model.index[a.wid], model.index[b.wid]}
    # chunks 30 and 31 are nobody's
    cs = LAYOUT.chunk_size
    assert (model.owner["v"][30 * cs:32 * cs] == -1).all()


def test_share_covers_the_area_once():
    pieces = share(0, 64 * 1024, 2)
    covered = np.zeros(64 * 1024, dtype=int)
    for slots, units in pieces:
        for lo, hi in slots:
            covered[lo:hi] += 1
        for u in units:
            covered[u:u + UNIT] += 1
    assert (covered == 1).all()


def test_the_pagemap_lays_chunks_then_the_user_blobs_head():
    pm = parse_strict(LAYOUT.pagemap_text())
    assert pm.num_pages == LAYOUT.num_pages
    rng = np.random.default_rng(1)
    view = rng.integers(0, 256, LAYOUT.capacity("v"), dtype=np.uint8)
    user = rng.integers(0, 256, LAYOUT.capacity("u"), dtype=np.uint8)
    cs = LAYOUT.chunk_size

    def read_fn(name: str, off: int, size: int, dst: memoryview) -> int:
        src = user if name == LAYOUT.user_name else \
            view[int(name[6:]) * cs:(int(name[6:]) + 1) * cs]
        dst[:size] = src[off:off + size].tobytes()
        return size

    for page in range(LAYOUT.num_pages):
        buf = bytearray(LAYOUT.page_size)
        assert read_page(pm, page, buf, read_fn).ok
        assert bytes(buf) == LAYOUT.page_bytes(page, view, user).tobytes(), page
    # a byte of the user blob is where name_of says
    name, off = LAYOUT.name_of("page", "u", 1000)
    page = int(name[5:])
    assert LAYOUT.page_bytes(page, view, user)[off] == user[1000]


def test_parts_all_minus_and_single_writers():
    every = [s.wid for s in writer_specs(LAYOUT, PARTS)]
    assert parse_parts(None) == [*every, "readers", "clones"]
    assert parse_parts("all,-mmap-chunk,-one-process/chunk,-readers") == \
        [w for w in [*every, "clones"] if w not in ("mmap-chunk/mmap", "mmap-chunk/chunk",
                                                    "one-process/chunk")]
    assert parse_parts("clones,view-chunk") == ["view-chunk/view", "view-chunk/chunk", "clones"]
    assert parse_parts("mmap-chunk/chunk") == ["mmap-chunk/chunk"]
    with pytest.raises(ValueError, match="unknown crossname part"):
        parse_parts("view-chunks")


# -- the point-in-time check ------------------------------------------------------------------

def _two_writers() -> tuple[Model, list[str]]:
    specs = writer_specs(LAYOUT, ["view-chunk"])
    view0 = bytes(range(256)) * (LAYOUT.source_size // 256)
    model = Model(LAYOUT, specs, view0, user_initial_bytes(LAYOUT, 0))
    return model, [s.wid for s in specs]


def _log(model: Model, wid: str, times: list[tuple[float, float]]) -> None:
    spec = model.specs[model.index[wid]]
    lo, _ = spec.slots[0]
    for seq, (t_issue, t_answer) in enumerate(times):
        model.add(wid, Op(seq, t_issue, math.inf, "w", "v", lo + seq, 10))
        model.add(wid, Op(seq, t_issue, t_answer, "w", "v", lo + seq, 10))


def _copy_with(model: Model, upto: dict[str, list[int]]) -> tuple[bytes, bytes]:
    """The view with each writer's listed ops applied in order (over the initial bytes)."""
    view = model.initial["v"][:LAYOUT.source_size].copy()
    for wid, seqs in upto.items():
        for seq in seqs:
            op = model.ops[wid][seq]
            view[op.addr:op.addr + op.n] = np.frombuffer(op_data(wid, seq, op.n), np.uint8)
    return view.tobytes(), model.initial["u"][:LAYOUT.user_initial].tobytes()


def test_a_copy_of_one_instant_is_point_in_time():
    model, (a, b) = _two_writers()
    _log(model, a, [(1.0, 1.1), (1.2, 1.3), (1.4, 1.5)])
    _log(model, b, [(1.05, 1.15), (1.25, 1.35)])
    view, user = _copy_with(model, {a: [0, 1], b: [0]})  # the tag at 1.32: a 2 ops, b 1 (+1?)
    verdict = model.check_copy(view, user, 1.31, 1.33, "clone")
    assert verdict.ok, verdict.problems
    assert verdict.prefixes == {a: [2], b: [1]}


def test_an_op_in_flight_may_be_in_the_copy_or_not():
    model, (a, b) = _two_writers()
    _log(model, a, [(1.0, 1.1), (1.2, 1.3)])
    _log(model, b, [(1.0, 1.1)])
    for seqs in ([0], [0, 1]):  # a's op 1 was in flight through the whole copy
        view, user = _copy_with(model, {a: seqs, b: [0]})
        assert model.check_copy(view, user, 1.22, 1.25, "clone").ok


def test_a_later_write_without_an_earlier_one_is_refused():
    model, (a, b) = _two_writers()
    _log(model, a, [(1.0, 1.1), (1.2, 1.3), (1.4, 1.5)])
    _log(model, b, [(1.0, 1.1)])
    view, user = _copy_with(model, {a: [0, 2], b: [0]})  # op 2 in, op 1 (answered before) not
    verdict = model.check_copy(view, user, 1.45, 1.47, "clone 7")
    assert not verdict.ok
    assert "clone 7: view-chunk/view holds no prefix" in verdict.problems[0]
    assert "#1 not in" in verdict.problems[0] or "written before it began" in \
        verdict.problems[0], verdict.problems


def test_a_write_answered_before_the_copy_began_must_be_in_it():
    model, (a, b) = _two_writers()
    _log(model, a, [(1.0, 1.1), (1.2, 1.3)])
    _log(model, b, [(1.0, 1.1)])
    view, user = _copy_with(model, {a: [0], b: [0]})
    verdict = model.check_copy(view, user, 1.35, 1.4, "clone")
    assert not verdict.ok and "written before it began are not in it" in verdict.problems[0]


def test_prefixes_of_two_different_instants_are_refused():
    model, (a, b) = _two_writers()
    # a's op 1 is answered at 1.3 before b's op 1 was issued at 1.4: holding b's op 1 but not
    # a's op 1 was never the tag's state, though each writer's part is some prefix
    _log(model, a, [(1.0, 1.1), (1.2, 1.3)])
    _log(model, b, [(1.0, 1.1), (1.4, 1.5)])
    view, user = _copy_with(model, {a: [0], b: [0, 1]})
    verdict = model.check_copy(view, user, 1.0, 2.0, "clone")
    assert not verdict.ok and "no one instant" in verdict.problems[0]


def test_bytes_nobody_owns_must_not_change():
    model, _ = _two_writers()
    view, user = _copy_with(model, {})
    broken = bytearray(view)
    broken[31 * LAYOUT.chunk_size] ^= 1
    verdict = model.check_copy(bytes(broken), user, 0.0, 1.0, "clone")
    assert not verdict.ok and "no writer owns" in verdict.problems[0]


def test_truncates_are_part_of_the_prefix():
    specs = writer_specs(LAYOUT, ["truncate"])
    model = Model(LAYOUT, specs, bytes(LAYOUT.source_size), user_initial_bytes(LAYOUT, 0))
    wid = "truncate/view"
    s = LAYOUT.source_size
    ops = [Op(0, 1.0, 1.1, "w", "v", s + 10, 100), Op(1, 1.2, 1.3, "t", "v", s + 50, 0),
           Op(2, 1.4, 1.5, "t", "v", s + 4096, 0)]
    for op in ops:
        model.add(wid, op)
    view = bytearray(s + 4096)
    view[s + 10:s + 50] = op_data(wid, 0, 100)[:40]
    user = user_initial_bytes(LAYOUT, 0)
    assert model.check_copy(bytes(view), user, 1.45, 1.6, "clone").ok  # grown back: zeros
    view[s + 60] = 7  # a byte the shrink cut must read zero after the growth
    assert not model.check_copy(bytes(view), user, 1.45, 1.6, "clone").ok
    assert not model.check_copy(bytes(view[:s + 50]), user, 1.55, 1.6, "clone").ok  # size
