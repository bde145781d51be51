"""The recycled read buffers: a buffer is reused only once no view of it is alive."""

from __future__ import annotations

import os

import pytest

from faultfs.buffers import HUGE, SMALL, BufferPool, pread_full
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
