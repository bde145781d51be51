"""The recycled read buffers: a buffer is reused only once no view of it is alive."""

from __future__ import annotations

import os

import pytest

from faultfs.buffers import HUGE, SMALL, BufferPool, Pieces, pread_full
from faultfs.store.blobfile import is_all_zero


def test_small_buffers_come_from_the_heap():
    pool = BufferPool()
    view = pool.alloc(SMALL - 1)
    assert len(view) == SMALL - 1 and isinstance(view.obj, bytearray)
    assert pool.mapped == 0


def test_a_buffer_is_reused_only_after_every_view_of_it_is_gone():
    pool = BufferPool()
    first = pool.alloc(SMALL)
    first[:5] = b"hello"
    held = first[1:4]  # a slice, as a reply or a blob held in memory would be
    del first
    second = pool.alloc(SMALL)
    assert pool.reused == 0 and pool.mapped == 2, "a live slice must keep its buffer lent"
    second[:5] = b"world"
    assert bytes(held) == b"ell"
    del held, second
    third = pool.alloc(SMALL)
    assert pool.reused == 1
    assert bytes(third[:5]) in (b"hello", b"world"), "recycled, not zeroed"


def test_free_buffers_beyond_the_keep_limit_are_unmapped():
    pool = BufferPool(keep_bytes=2 * SMALL)
    views = [pool.alloc(SMALL) for _ in range(5)]
    del views
    pool.alloc(1 << 20)  # reclaims the five: two are kept, three unmapped
    assert pool.free_bytes == 2 * SMALL
    pool.clear()
    assert pool.free_bytes == 0


def test_sizes_are_not_mixed():
    pool = BufferPool()
    a = pool.alloc(HUGE)
    del a
    b = pool.alloc(SMALL)
    assert len(b) == SMALL and pool.reused == 0
    c = pool.alloc(HUGE)
    assert len(c) == HUGE and pool.reused == 1


def test_pread_full_reads_to_the_size_or_end_of_file(tmp_path):
    path = tmp_path / "f"
    data = os.urandom(SMALL * 3 + 123)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert bytes(pread_full(fd, SMALL * 2, 100)) == data[100:100 + SMALL * 2]
        assert bytes(pread_full(fd, SMALL * 2, SMALL * 2)) == data[SMALL * 2:]
        assert bytes(pread_full(fd, 10, len(data))) == b""
    finally:
        os.close(fd)


@pytest.mark.parametrize(("data", "zero"), [
    (b"", True),
    (bytes(300_000), True),
    (bytes(150_000) + b"\x01" + bytes(150_000), False),
    (b"\x01" + bytes(10), False),
    (bytes(10) + b"\x01", False),
])
def test_is_all_zero_on_bytes_and_views(data, zero):
    assert is_all_zero(data) is zero
    assert is_all_zero(memoryview(bytearray(data))) is zero


def test_a_new_read_size_displaces_free_buffers_of_an_old_one():
    pool = BufferPool(keep_bytes=4 * SMALL)
    old = [pool.alloc(2 * SMALL) for _ in range(2)]  # fill the free list with one size
    del old
    for _ in range(3):
        view = pool.alloc(SMALL)
        del view
    assert pool.mapped == 3 and pool.reused == 2, "the new size is kept and reused"


def test_pieces_are_buffers_of_their_own_allocated_as_they_are_reached():
    piece = SMALL
    dest = Pieces(3 * piece + 10, piece)
    assert len(dest) == 3 * piece + 10 and dest._parts == [None] * 4
    head = dest[0:100]  # inside the first piece: a view of it, allocated now
    assert isinstance(head, memoryview) and len(head) == 100
    assert dest._parts[1:] == [None, None, None], "the others not yet"
    across = dest[piece - 4:3 * piece + 10]  # across pieces: a window onto the same ones
    assert isinstance(across, Pieces) and len(across) == 2 * piece + 14
    assert across.edge(0) == 4 and across.edge(4) == piece + 4 and across.edge(2 * piece + 5) == 2 * piece + 14
    across[0:4][:] = b"abcd"  # writes through a window land in the destination's pieces
    across[4:8][:] = b"efgh"
    assert bytes(dest[piece - 4:piece]) == b"abcd" and bytes(dest[piece:piece + 4]) == b"efgh"
    assert len(dest[3 * piece:]) == 10 and len(dest._parts[3]) == 10, "the last one shorter"
    views = [dest[i * piece:(i + 1) * piece] for i in range(3)]
    assert len({id(v.obj) for v in views}) == 3 and all(len(v.obj) == piece for v in views)
    assert len(dest[5:5]) == 0 and len(dest[7:3]) == 0
    with pytest.raises(TypeError):
        dest[0:10:2]


def test_a_piece_goes_back_to_the_pool_alone():
    import faultfs.buffers as buffers

    pool = BufferPool()
    old, buffers.POOL = buffers.POOL, pool
    try:
        dest = Pieces(3 * SMALL, SMALL)
        kept = [dest[i * SMALL:(i + 1) * SMALL] for i in range(3)]
        del dest
        kept.pop(0)  # one blob dropped from memory while its siblings are held
        pool.alloc(SMALL)
        assert pool.reused == 1, "its buffer is free for the next read, the others held"
    finally:
        buffers.POOL = old
