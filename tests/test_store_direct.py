"""New clean blobs written around the page cache (``store/direct.py``): a page-aligned payload
of whole pages goes out in one ``O_DIRECT`` ``pwritev`` and reads back exactly; anything else,
a file system that refuses ``O_DIRECT``, a refused or short vectored write all end in the same
verified blob through the page cache; ``FAULTFS_STORE_DIRECT=0`` reaches the store."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import pytest

from faultfs.buffers import SMALL, alloc
from faultfs.config import Config
from faultfs.store import direct
from faultfs.store.blobfile import FLAG_NO_FAULT, HEADER_LEN
from faultfs.store.blobstore import BlobStore

MiB = 1 << 20


@pytest.fixture
def store(tmp_path):
    s = BlobStore(str(tmp_path / "store"))
    s.write_tag_state("t", {})  # the tag's directory: made by this store, as a mount does
    return s


def pooled(data: bytes) -> memoryview:
    view = alloc(len(data))  # the page-aligned buffers faults read into (SMALL and up)
    view[:] = data
    return view


def test_only_writable_page_aligned_whole_pages_qualify():
    view = alloc(MiB)
    assert direct.aligned(view) and direct.aligned(view[4096:])
    assert not direct.aligned(view[1:4097]), "unaligned address"
    assert not direct.aligned(view[:5000]), "not whole pages"
    assert not direct.aligned(memoryview(bytes(8192))), "read-only: its address is not ours"


def spy(monkeypatch):
    calls = []
    real = os.pwritev

    def pwritev(fd, buffers, off):
        calls.append(fcntl.fcntl(fd, fcntl.F_GETFL) & direct.O_DIRECT)
        return real(fd, buffers, off)

    monkeypatch.setattr(direct.os, "pwritev", pwritev)
    return calls


@pytest.mark.parametrize("size", [MiB, SMALL, SMALL + 3 * 4096])
def test_an_aligned_blob_is_written_around_the_page_cache_and_reads_back(store, monkeypatch, size):
    data = random.Random(size).randbytes(size)
    calls = spy(monkeypatch)
    assert store.put_new("t", "chunk_0", pooled(data), flags=FLAG_NO_FAULT,
                         source_version="v") == HEADER_LEN + size
    assert calls == [direct.O_DIRECT], "one vectored write, with O_DIRECT"
    assert store.read("t", "chunk_0", source_version="v") == data
    assert os.path.getsize(store.blob_path("t", "chunk_0")) == HEADER_LEN + size


@pytest.mark.parametrize("payload", [
    lambda d: d,  # bytes: read-only
    lambda d: pooled(b"x" + d)[1:],  # unaligned
], ids=["bytes", "unaligned"])
def test_other_payloads_take_the_page_cache(store, monkeypatch, payload):
    data = random.Random(2).randbytes(MiB)
    calls = spy(monkeypatch)
    store.put_new("t", "chunk_1", payload(data), flags=FLAG_NO_FAULT)
    assert calls == []
    assert store.read("t", "chunk_1") == data
    assert store.direct, "an unsuitable buffer is no reason to stop trying"


def test_a_short_tail_takes_the_page_cache(store, monkeypatch):
    data = random.Random(3).randbytes(MiB - 100)
    calls = spy(monkeypatch)
    store.put_new("t", "chunk_2", pooled(data), flags=FLAG_NO_FAULT)
    assert calls == [] and store.read("t", "chunk_2") == data


def test_a_file_system_that_refuses_o_direct_is_not_asked_again(store, monkeypatch):
    real = fcntl.fcntl
    asked = []

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & direct.O_DIRECT:
            asked.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    blobs = {f"chunk_{i}": random.Random(i).randbytes(MiB) for i in range(3)}
    for name, data in blobs.items():
        store.put_new("t", name, pooled(data), flags=FLAG_NO_FAULT)
    assert len(asked) == 1 and not store.direct
    for name, data in blobs.items():
        assert store.read("t", name) == data


@pytest.mark.parametrize("written", [0, 2048, HEADER_LEN, HEADER_LEN + 4096, "einval"])
def test_a_short_or_refused_vectored_write_is_finished_through_the_page_cache(
        store, monkeypatch, written):
    data = random.Random(4).randbytes(MiB)
    real = os.pwritev

    def short(fd, buffers, off):
        if written == "einval":
            raise OSError(errno.EINVAL, "Invalid argument")
        flat = b"".join(bytes(b) for b in buffers)[:written]
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~direct.O_DIRECT)
        return real(fd, [flat], off) if flat else 0

    monkeypatch.setattr(direct.os, "pwritev", short)
    store.put_new("t", "chunk_3", pooled(data), flags=FLAG_NO_FAULT)
    assert store.read("t", "chunk_3") == data
    assert os.path.getsize(store.blob_path("t", "chunk_3")) == HEADER_LEN + MiB
    assert store.direct


def test_a_full_device_mid_write_is_store_full_and_leaves_nothing(store, monkeypatch):
    from faultfs.errors import StoreFull

    def full(fd, buffers, off):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct.os, "pwritev", full)
    with pytest.raises(StoreFull):
        store.put_new("t", "chunk_4", pooled(bytes(range(256)) * 4096), flags=FLAG_NO_FAULT)
    assert not os.path.exists(store.blob_path("t", "chunk_4"))


def test_the_setting_reaches_the_store_from_the_environment():
    assert Config.build(env={}).store_direct
    assert not Config.build(env={"FAULTFS_STORE_DIRECT": "0"}).store_direct
