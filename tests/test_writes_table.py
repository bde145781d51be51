"""The dirty-blob table (``engine/writes/table.py``), the only code that changes a blob's base,
the bytes held in memory and the counts: every transition keeps ``held`` the sum of what the
blobs in the table hold and ``direct_count`` the number of them over a direct file, lets a
source chunk's pin go when nothing lies over it any more, and puts a direct file a blob left
in ``obsolete``; a transition a state does not allow is refused."""

from __future__ import annotations

import types

import pytest

from faultfs.core.chunks import ChunkLayout
from faultfs.core.extents import Ref
from faultfs.engine.writes.table import (
    CLEAN,
    DIRECT,
    FOLDED,
    NEW,
    DirtyBlob,
    DirtyTable,
    part_name,
)

CHUNK = 4096


@pytest.fixture
def tag():
    return types.SimpleNamespace(id=7, name="t", layout=ChunkLayout(0, 4 * CHUNK, CHUNK))


@pytest.fixture
def unpinned():
    return []


@pytest.fixture
def table(unpinned):
    return DirtyTable(lambda tag, index: unpinned.append(index))


def held(data: bytes) -> Ref:
    return Ref(1, 0, len(data), 0, 0, len(data), data)


def sums(table: DirtyTable) -> tuple[int, int]:
    """What the table's counts should be, worked out from its blobs."""
    return (sum(b.pending.held for b in table),
            sum(1 for b in table if b.base is DIRECT))


def test_held_bytes_and_direct_files_follow_the_blobs_in_and_out(table, tag, unpinned):
    a, b = table.chunk_blob(tag, 0), table.chunk_blob(tag, 1)
    table.write(a, 10, held(b"x" * 100))
    table.write(b, 0, held(b"y" * 50))
    table.set_direct(table.chunk_blob(tag, 2), 5)
    assert (table.held, table.direct_count) == sums(table) == (150, 1)
    out = table.forget((tag.id, a.name))
    assert (table.held, table.direct_count) == sums(table) == (50, 1)
    assert unpinned == [2, 0], "a chunk written whole, then one taken out, let their pins go"
    table.add(out)  # put back as it was (a failed reset): its bytes count again
    assert (table.held, table.direct_count) == sums(table) == (150, 1)
    table.forget((tag.id, "chunk_2"))
    assert (table.held, table.direct_count) == sums(table) == (150, 0)
    table.spill()
    assert table.held == sums(table)[0] == 0


def test_a_chunk_leaving_its_clean_base_lets_its_pin_go(table, tag, unpinned):
    new = table.chunk_blob(tag, 0)
    table.set_new(new)  # zeroed whole
    assert new.base is NEW and unpinned == [0]
    folded = table.chunk_blob(tag, 1)
    table.write(folded, 0, held(b"z"))
    table.set_folded(folded, 9, CHUNK)
    assert (folded.base, folded.folded_seq, folded.folded_size) == (FOLDED, 9, CHUNK)
    assert unpinned == [0, 1] and table.held == 0
    past = table.chunk_blob(tag, 6)  # past the source: nothing beneath, nothing pinned
    assert past.base is NEW
    table.forget((tag.id, past.name))
    user = table.user_part_blob(tag, 3, 0)
    table.forget((tag.id, user.name))
    assert unpinned == [0, 1]


def test_a_direct_file_a_blob_leaves_is_obsolete_unless_it_was_renamed(table, tag):
    blob = table.chunk_blob(tag, 0)
    table.set_direct(blob, 5)
    table.set_direct(blob, 8)  # written whole again: record 5 may still be replayed
    assert table.obsolete == [("t", 5)] and table.direct_count == 1
    table.set_folded(blob, 8, CHUNK, renamed=True)  # the direct file became its dirty file
    assert table.obsolete == [("t", 5)] and table.direct_count == 0 and blob.direct == 0
    table.set_direct(blob, 11)
    table.write(blob, 0, held(b"w"))
    table.set_folded(blob, 12, CHUNK)  # folded by a copy: file 11 is no one's
    assert table.obsolete == [("t", 5), ("t", 11)] and table.direct_count == 0
    assert table.held == 0


def test_a_damaged_blob_leaves_its_direct_file_for_its_older_dirty_file(table, tag):
    blob = table.chunk_blob(tag, 0)
    table.set_direct(blob, 5)
    with pytest.raises(AssertionError):
        table.leave_direct(blob)  # only a damaged blob's file is set aside so
    blob.damaged = "a write does not verify"
    assert table.leave_direct(blob) == 5
    assert (blob.base, blob.direct, table.direct_count, table.obsolete) == (FOLDED, 0, 0, [])


def test_transitions_a_state_does_not_allow_are_refused(table, tag):
    user = table.user_part_blob(tag, 1, 0)
    with pytest.raises(AssertionError):
        table.set_new(user)  # NEW already: it never lay over a source chunk
    with pytest.raises(AssertionError):
        table.set_base_bytes(user, b"source bytes")  # only a CLEAN base holds them
    chunk = table.chunk_blob(tag, 0)
    table.set_base_bytes(chunk, b"s" * CHUNK)
    with pytest.raises(AssertionError):
        table.set_new(chunk)  # its base is held: a write lies over it, not nothing


def test_resizes_and_zeros_keep_the_count_of_held_bytes(table, tag):
    part = table.user_part_blob(tag, 4, 0)
    table.write(part, 0, held(b"a" * 300))
    assert part.size == 300
    table.resize(part, 100)
    table.zero(part, 20, 10)
    assert table.held == sums(table)[0] and part.size == 100 and part.cut == 100
    assert table.user_size(tag, 4, True) == 100


def test_a_blob_out_of_the_table_is_not_counted_until_it_is_added(table, tag):
    outside = DirtyBlob(tag, part_name(9, 0), None, 0, NEW)  # a reset's, while it is merged
    outside.pending.write(0, held(b"m" * 40))
    assert table.held == 0
    table.add(outside)
    assert table.held == 40 and table.parts(tag, 9) == {0: outside}
    assert CLEAN is table.chunk_blob(tag, 3).base
