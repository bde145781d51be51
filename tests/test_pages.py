"""PageService without a mount: loading, page reads through the fault path, .pagemap handles.

Sources are real local files under tmp_path; the store is a real BlobStore. Real-mount tests
of the same behaviour are in tests/test_mount_pages.py.
"""

from __future__ import annotations

import errno
import os

import pytest
import trio

from faultfs.config import Config
from faultfs.core.context import FaultContext
from faultfs.core.pagemap import PageExtent, build
from faultfs.engine import Engine
from faultfs.engine.pages import MAX_PAGES_SHOWN, PAGEMAP_BLOB
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.store.blobfile import FLAG_DIRTY
from faultfs.store.blobstore import BlobStore

CS = 4096


def payload(n: int) -> bytes:
    return bytes((i * 13 + i // 253) & 0xFF for i in range(n))


@pytest.fixture
def setup(tmp_path):
    """``(engine, tag, data)`` over a 10-chunk-and-a-bit local file."""
    data = payload(10 * CS + 123)
    src = tmp_path / "field.bin"
    src.write_bytes(data)
    store = BlobStore(str(tmp_path / "store"))
    engine = Engine(store, Config(store_dir=store.root, reserve_mb=0))
    tag = engine.register(FaultContext(src=str(src), dst="t", chunk_size=CS))
    yield engine, tag, data
    engine.close()


def put_map(engine, tag, text: str) -> None:
    engine.store.put(tag.name, PAGEMAP_BLOB, text.encode(), flags=FLAG_DIRTY, durable=True)


def model_page(extents, page_size, page_id, blobs) -> bytes:
    """The expected page, byte by byte, from the extent list (no pagify involved)."""
    out = bytearray(page_size)
    lo = page_id * page_size
    for name, blob_off, page_off, size in extents:
        for k in range(size):
            p = page_off + k - lo
            if 0 <= p < page_size:
                out[p] = blobs[name][blob_off + k]
    return bytes(out)


def test_no_pagemap_means_no_pages(setup):
    engine, tag, _ = setup
    assert not engine.pages.has_pagemap(tag)
    assert engine.pages.num_pages(tag) == 0
    assert engine.pages.pagemap_size(tag) == 0
    with pytest.raises(FaultfsError) as info:
        trio.run(engine.pages.read_page, tag, 0, 0, 10)
    assert info.value.errno == errno.ENOENT


def test_page_from_several_chunks_with_gaps_faults_in_parallel(setup):
    engine, tag, data = setup
    chunks = {f"chunk_{i}": data[i * CS:(i + 1) * CS].ljust(CS, b"\0") for i in range(11)}
    extents = [("chunk_0", 0, 0, 1000), ("chunk_1", 100, 1000, 2000), ("chunk_2", 0, 4000, 1000),
               ("chunk_3", 4000, 5000, 96), ("chunk_10", 0, 9000, 200)]
    put_map(engine, tag, "pagemap\npage_size=8192\n"
            + "".join(f"{n} {b} {p} {s}\n" for n, b, p, s in extents))

    async def main():
        pm = await engine.pages.load(tag)
        assert pm.page_size == 8192 and engine.pages.num_pages(tag) == 2
        page0 = await engine.pages.read_page(tag, 0, 0, 8192)
        assert page0 == model_page(extents, 8192, 0, chunks)
        # a window crossing a slice boundary and a gap
        assert await engine.pages.read_page(tag, 0, 2990, 1020) == page0[2990:4010]
        assert await engine.pages.read_page(tag, 1, 0, 8192) == model_page(extents, 8192, 1, chunks)
        assert await engine.pages.read_page(tag, 1, 8192, 10) == b""

    trio.run(main)
    c = engine.stats.counters
    assert c["faults"] == 5  # chunk_0..3 and chunk_10, each once
    assert c["page_reads"] == 3 and c["page_slices"] == 4 + 2 + 1
    assert c["page_errors"] == 0


def test_missing_plain_blob_fails_with_eio_and_stored_blob_is_read(setup):
    engine, tag, data = setup
    engine.store.put(tag.name, "extra", b"hello world", flags=FLAG_DIRTY)
    put_map(engine, tag, "pagemap\npage_size=100\nextra 6 10 5\nchunk_0 0 20 10\n"
            "nothere 0 100 5\nchunk_0 4050 200 100\n")

    async def main():
        page0 = await engine.pages.read_page(tag, 0, 0, 100)
        assert page0 == bytes(10) + b"world" + bytes(5) + data[:10] + bytes(70)
        for page in (1, 2):  # a blob that does not exist; a slice past the chunk's end
            with pytest.raises(FaultfsError) as info:
                await engine.pages.read_page(tag, page, 0, 100)
            assert info.value.errno == errno.EIO

    trio.run(main)
    assert engine.stats.counters["page_errors"] == 2


def test_source_error_fails_the_page(setup, tmp_path):
    engine, tag, _ = setup
    put_map(engine, tag, "pagemap\npage_size=8192\nchunk_0 0 0 4096\nchunk_9 0 4096 4096\n")
    os.truncate(tmp_path / "field.bin", 5 * CS)
    with pytest.raises(FaultfsError) as info:
        trio.run(engine.pages.read_page, tag, 0, 0, 8192)
    assert info.value.errno == errno.EIO
    assert engine.stats.counters["page_errors"] == 1


def test_load_once_and_share_concurrent_loads(setup, monkeypatch):
    engine, tag, _ = setup
    put_map(engine, tag, "pagemap\npage_size=10\nchunk_0 0 0 25\n")
    calls = []
    real = engine.pages._read_blocking

    def counting(t):
        calls.append(t.name)
        return real(t)

    monkeypatch.setattr(engine.pages, "_read_blocking", counting)

    async def main():
        async with trio.open_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(engine.pages.load, tag)
        assert engine.pages.num_pages(tag) == 3

    trio.run(main)
    assert calls == ["t"]


def test_pagemap_handles_validate_on_flush_and_notify(setup):
    engine, tag, data = setup
    put_map(engine, tag, "pagemap\npage_size=10\nchunk_0 0 0 25\n")
    changes = []

    async def listener(t, before, after):
        changes.append((t.name, before, after))

    engine.pages.subscribe(listener)

    async def main():
        fh = await engine.pages.open_pagemap(tag, os.O_RDWR)
        assert fh >= 1
        assert engine.pages.handle_read(fh, 0, 100) == b"pagemap\npage_size=10\nchunk_0 0 0 25\n"
        engine.pages.handle_truncate(fh, 0)
        engine.pages.handle_write(fh, 0, b"pagemap\npage_size=10\nchunk_0 oops\n")
        with pytest.raises(InvalidInput) as info:
            await engine.pages.flush(fh)
        assert info.value.errno == errno.EINVAL and "line 3" in info.value.message
        assert engine.pages.num_pages(tag) == 3  # the old map stays
        await engine.pages.close(fh)  # refused once: release does not retry
        assert changes == []

        fh = await engine.pages.open_pagemap(tag, os.O_WRONLY | os.O_TRUNC)
        text = b"pagemap\npage_size=4\nchunk_1 1 0 5\n"
        engine.pages.handle_write(fh, 0, text[:10])
        engine.pages.handle_write(fh, 10, text[10:])
        await engine.pages.flush(fh)
        await engine.pages.flush(fh)  # nothing new: no second install
        await engine.pages.close(fh)
        assert changes == [("t", 3, 2)]
        assert engine.pages.pagemap_size(tag) == len(text)
        assert await engine.pages.read_page(tag, 1, 0, 4) == data[CS + 5:CS + 6] + bytes(3)
        with pytest.raises(FaultfsError) as info:
            engine.pages.handle_read(fh, 0, 1)
        assert info.value.errno == errno.EBADF

        fh = await engine.pages.open_pagemap(tag, os.O_RDONLY)
        with pytest.raises(FaultfsError):
            engine.pages.handle_write(fh, 0, b"x")
        await engine.pages.close(fh)

        fh = await engine.pages.open_pagemap(tag, os.O_WRONLY)
        with pytest.raises(FaultfsError) as info:
            engine.pages.handle_write(fh, 64 << 20, b"x")
        assert info.value.errno == errno.EFBIG
        engine.pages.handle_write(fh, 0, b"\xff\xfe")  # not UTF-8: refused at release
        await engine.pages.close(fh)
        assert engine.pages.num_pages(tag) == 2

    trio.run(main)
    assert engine.store.read(tag.name, PAGEMAP_BLOB) == b"pagemap\npage_size=4\nchunk_1 1 0 5\n"


def test_rewrite_survives_a_new_engine(setup):
    engine, tag, data = setup

    async def write():
        fh = await engine.pages.open_pagemap(tag, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        engine.pages.handle_write(fh, 0, b"pagemap\npage_size=3\nchunk_2 7 1 4\n")
        await engine.pages.close(fh)

    trio.run(write)
    engine.close()
    store = engine.store
    again = Engine(store, Config(store_dir=store.root, reserve_mb=0))
    again.recover()
    tag2 = again.tags["t"]
    assert again.pages.has_pagemap(tag2) and again.pages.num_pages(tag2) == 2
    assert trio.run(again.pages.read_page, tag2, 0, 0, 3) == b"\0" + data[2 * CS + 7:2 * CS + 9]
    again.close()


@pytest.mark.parametrize("page_size", [1000, CS, 3 * CS + 1, 1 << 20])
def test_identity_pages_are_the_range(setup, page_size):
    engine, tag, data = setup
    engine.write_identity_pagemap(tag, page_size)
    n = engine.pages.num_pages(tag)
    assert n == -(-len(data) // page_size)

    async def main():
        return b"".join([await engine.pages.read_page(tag, i, 0, page_size) for i in range(n)])

    pages = trio.run(main)
    assert pages == data + bytes(n * page_size - len(data))
    stored = engine.store.read(tag.name, PAGEMAP_BLOB)
    engine.write_identity_pagemap(tag, page_size)  # the same map again: nothing rewritten
    assert engine.store.read(tag.name, PAGEMAP_BLOB) == stored


def test_identity_refuses_a_page_size_over_1_gib(setup):
    engine, tag, _ = setup
    with pytest.raises(InvalidInput):
        engine.write_identity_pagemap(tag, (1 << 30) + 1)
    assert not engine.pages.has_pagemap(tag)


def test_unusable_stored_maps_show_no_pages(setup):
    engine, tag, _ = setup
    put_map(engine, tag, "pagemap\nchunk_0 0 0 10\n")  # no page_size: the empty map
    assert engine.pages.has_pagemap(tag) and engine.pages.num_pages(tag) == 0


def test_tiny_pages_over_a_huge_range_are_clamped_to_the_inode_space(setup):
    engine, tag, _ = setup
    put_map(engine, tag, build(1, [PageExtent("chunk_0", 0, 0, 1 << 40)]).serialize())
    assert engine.pages.num_pages(tag) == MAX_PAGES_SHOWN


def test_every_rewrite_moves_the_pages_mtime_forward(setup):
    engine, tag, _ = setup

    async def main():
        seen = []
        for size in (10, 20, 30):
            fh = await engine.pages.open_pagemap(tag, os.O_WRONLY | os.O_TRUNC)
            engine.pages.handle_write(fh, 0, f"pagemap\npage_size={size}\nchunk_0 0 0 99\n".encode())
            await engine.pages.close(fh)
            seen.append(engine.pages.pagemap_mtime_ns(tag))
        return seen

    seen = trio.run(main)
    assert seen == sorted(set(seen))  # strictly increasing even within one clock tick


def test_damaged_stored_pagemap_is_shown_unusable_not_an_error(setup):
    engine, tag, _ = setup
    put_map(engine, tag, "pagemap\npage_size=4096\nchunk_0 0 0 4096\n")
    path = engine.store.blob_path(tag.name, PAGEMAP_BLOB)
    with open(path, "r+b") as f:  # flip a payload byte: the header still verifies
        f.seek(4096 + 3)
        byte = f.read(1)
        f.seek(4096 + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert engine.pages.has_pagemap(tag), "the damaged map is shown, so it can be rewritten"
    assert engine.pages.num_pages(tag) == 0
    assert os.path.exists(path), "a user-written blob is never deleted on a checksum failure"


def test_a_page_of_many_slices_does_not_starve_other_readers(tmp_path):
    """A valid pagemap of one-byte slices from thousands of blobs once queued a fault per
    slice at once: every other read of the mount waited behind them."""
    import time

    from faultfs.testing.fakes import ctx_for, engine_for, make_source

    n = 4096
    data = payload(n * 512)
    src = make_source(data, url="mem://many")
    src.delay_s = 0.001
    other = make_source(payload(4096), url="mem://other")
    store = BlobStore(str(tmp_path / "store"))
    engine = engine_for(store)
    tag = engine.register(ctx_for("mem://many", "many", chunk_size=512))
    quiet = engine.register(ctx_for("mem://other", "quiet", chunk_size=512))
    text = f"pagemap\npage_size={n}\n" + "".join(f"chunk_{i} 0 {i} 1\n" for i in range(n))
    engine.store.put(tag.name, PAGEMAP_BLOB, text.encode(), flags=FLAG_DIRTY, durable=True)
    waits = []

    async def main():
        async def page():
            got = await engine.pages.read_page(tag, 0, 0, n)
            assert got == bytes(data[i * 512] for i in range(n))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(page)
            await trio.sleep(0.05)  # the page read is under way
            for i in range(8):
                started = time.monotonic()
                assert bytes(await engine.read_blob(quiet, i % 8, 0, 64)) == other.data[
                    (i % 8) * 512:(i % 8) * 512 + 64]
                waits.append(time.monotonic() - started)

    trio.run(main)
    engine.close()
    # starved, every read waits behind the page's faults; on a loaded host the first read of
    # the other tag alone may be slow for its own reasons (1.4 s once at load 17)
    slow = [round(w, 2) for w in waits if w >= 0.5]
    assert len(slow) <= 1, f"another tag's reads waited behind the page: {slow} s"
    assert src.reads <= n, "each blob of the page was fetched once"


def test_a_page_over_the_slice_limit_is_refused(setup):
    from faultfs.core.pagemap import MAX_PAGE_SLICES

    engine, tag, _ = setup
    text = f"pagemap\npage_size={MAX_PAGE_SLICES + 1}\n" + "".join(
        f"chunk_0 0 {i} 1\n" for i in range(MAX_PAGE_SLICES + 1))

    async def write():
        fh = await engine.pages.open_pagemap(tag, os.O_WRONLY | os.O_TRUNC)
        engine.pages.handle_write(fh, 0, text.encode())
        try:
            await engine.pages.flush(fh)
        finally:
            await engine.pages.close(fh)

    with pytest.raises(InvalidInput, match=f"over the limit of {MAX_PAGE_SLICES}"):
        trio.run(write)
    assert not engine.pages.has_pagemap(tag)
