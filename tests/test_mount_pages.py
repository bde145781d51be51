"""Pages in real mounts: page:N files composed from blobs, writing .pagemap, --page-size.

Each test mounts a small random source with 4 KiB chunks through the CLI (daemonized) and
checks page bytes against a byte-by-byte model of the extents, independent of pagify.
"""

from __future__ import annotations

import errno
import os

import pytest
from conftest import run_faultfs

from faultfs.store.blobfile import FLAG_DIRTY
from faultfs.store.blobstore import BlobStore

pytestmark = pytest.mark.mount

CS = 4096
CHUNKED = ["--chunk-size", "4K", "--prefetch-mb", "0"]  # exact fault counts: no prefetch


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pread(path: str, off: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, off)
    finally:
        os.close(fd)


def write_pagemap(tag_dir: str, text: bytes | str) -> None:
    """Write ``<tag>/.pagemap`` in one open/write/close; OSError(EINVAL) when refused."""
    data = text.encode() if isinstance(text, str) else text
    fd = os.open(os.path.join(tag_dir, ".pagemap"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)  # the map is validated and installed here


def map_text(page_size: int, extents) -> str:
    return f"pagemap\npage_size={page_size}\n" + "".join(f"{n} {b} {p} {s}\n" for n, b, p, s in extents)


def chunks_of(data: bytes) -> dict[str, bytes]:
    n = -(-len(data) // CS)
    return {f"chunk_{i}": data[i * CS:(i + 1) * CS].ljust(CS, b"\0") for i in range(n)}


def model_pages(page_size: int, extents, blobs) -> list[bytes]:
    """Every page, byte by byte from the extents (first writer wins, gaps are zeros)."""
    kept, end = [], 0
    for e in sorted(extents, key=lambda e: e[2]):
        if e[3] and e[2] >= end:
            kept.append(e)
            end = e[2] + e[3]
    space = bytearray(-(-end // page_size) * page_size)
    for name, blob_off, page_off, size in kept:
        space[page_off:page_off + size] = blobs[name][blob_off:blob_off + size]
    return [bytes(space[i:i + page_size]) for i in range(0, len(space), page_size)]


def page_names(tag_dir: str) -> list[str]:
    return sorted((n for n in os.listdir(tag_dir) if n.startswith("page:")),
                  key=lambda n: int(n[5:]))


def errno_of(fn, *args) -> int:
    try:
        fn(*args)
    except OSError as exc:
        return exc.errno
    raise AssertionError(f"{fn.__name__}{args} did not fail")


# A page of 8 KiB from four chunks, a gap, a blob covering part of a page, a faulted blob.
EXTENTS = [
    ("chunk_0", 0, 0, 1000),         # page 0 [0, 1000)
    ("chunk_1", 100, 1000, 2000),    # page 0 [1000, 3000)
    ("chunk_2", 0, 4000, 1000),      # gap [3000, 4000), then [4000, 5000)
    ("chunk_3", 4000, 5000, 96),     # [5000, 5096), zeros to the page end
    ("chunk_2", 500, 4500, 10),      # overlaps chunk_2's extent: dropped whole
    ("chunk_4", 96, 8192 + 1000, 3000),  # page 1: zeros around one blob slice
    ("chunk_9", 0, 3 * 8192 + 10, 50),   # page 2 all gap; page 3 needs an unfetched blob
]


def test_pages_compose_blobs_with_gaps_and_fault_what_they_need(mounter, sample):
    src = sample(10 * CS + 500)
    data = read(src)
    m = mounter(src, args=CHUNKED)
    tag = m.tag("field")
    assert ".pagemap" not in os.listdir(tag) and not page_names(tag)
    write_pagemap(tag, map_text(8192, EXTENTS))
    expected = model_pages(8192, EXTENTS, chunks_of(data))
    assert len(expected) == 4

    names = page_names(tag)
    assert names == [f"page:{i}" for i in range(4)]
    assert ".pagemap" in os.listdir(tag)
    assert all(os.stat(os.path.join(tag, n)).st_size == 8192 for n in names)
    assert read(os.path.join(tag, ".pagemap")) == map_text(8192, EXTENTS).encode()
    for missing in ("page:4", "page:04", "page:-1", "page:"):
        assert errno_of(os.stat, os.path.join(tag, missing)) == errno.ENOENT

    before = m.counters()
    assert read(os.path.join(tag, "page:0")) == expected[0]
    after = m.counters()
    assert after["faults"] - before["faults"] == 4  # chunk_0..chunk_3, once each
    assert after["page_slices"] - before["page_slices"] == 4
    assert after["page_reads"] > before["page_reads"]
    # windows crossing slice edges and the gap
    for off, size in ((990, 20), (2995, 1010), (5090, 3102), (0, 8192)):
        assert pread(os.path.join(tag, "page:0"), off, size) == expected[0][off:off + size]
    assert read(os.path.join(tag, "page:1")) == expected[1]
    assert read(os.path.join(tag, "page:2")) == bytes(8192)

    before = m.counters()
    assert read(os.path.join(tag, "page:3")) == expected[3]
    after = m.counters()
    assert after["faults"] - before["faults"] == 1  # chunk_9 was never touched before
    assert read(os.path.join(tag, "chunk_9")) == chunks_of(data)["chunk_9"]
    assert m.counters()["faults"] == after["faults"]  # now a hit
    assert after["page_errors"] == 0
    stat = run_faultfs("stat", m.path, check=True).stdout
    assert "page reads" in stat


def test_malformed_pagemap_is_refused_and_the_old_map_stays(mounter, sample, tmp_path):
    src = sample(8 * CS)
    data = read(src)
    m = mounter(src, args=CHUNKED)
    tag = m.tag("field")
    good = map_text(4096, [("chunk_3", 0, 0, 4096), ("chunk_1", 0, 4096, 100)])
    write_pagemap(tag, good)
    page0 = read(os.path.join(tag, "page:0"))
    assert page0 == data[3 * CS:4 * CS]

    bad_maps = [
        "pagemap\npage_size=4096\nchunk_0 zero 0 10\n",   # not an extent
        "pagemap\nchunk_0 0 0 10\n",                      # no page_size
        "pagemap\npage_size=4096\nchunk_0 -1 0 10\n",     # negative
        "pagemap\npage_size=0\n",                         # page size 0
        "pagemap\npage_size=4096\npage:0 0 0 10\n",       # a page made of pages
        b"pagemap\npage_size=4096\n\xff 0 0 1\n",         # not UTF-8
        "",                                               # empty
    ]
    for bad in bad_maps:
        assert errno_of(write_pagemap, tag, bad) == errno.EINVAL, bad
    assert read(os.path.join(tag, ".pagemap")) == good.encode()
    assert page_names(tag) == ["page:0", "page:1"]
    assert read(os.path.join(tag, "page:0")) == page0

    # the CLI refuses before writing; a write that would exceed the text limit is EFBIG
    bad_file = tmp_path / "bad.map"
    bad_file.write_text(bad_maps[0])
    result = run_faultfs("pagemap", "set", tag, str(bad_file))
    assert result.returncode != 0 and "nothing written" in result.stderr
    fd = os.open(os.path.join(tag, ".pagemap"), os.O_WRONLY)
    try:
        assert errno_of(os.pwrite, fd, b"x", 64 << 20) == errno.EFBIG
    finally:
        os.close(fd)
    assert read(os.path.join(tag, ".pagemap")) == good.encode()
    assert m.counters()["page_errors"] == 0


def test_pagemap_cli_rewrite_invalidates_pages_and_survives_remount(mounter, sample, tmp_path):
    src = sample(12 * CS + 7)
    data = read(src)
    blobs = chunks_of(data)
    m = mounter(src, args=CHUNKED)
    tag = m.tag("field")

    first = [(f"chunk_{i}", 0, i * 1000, 1000) for i in range(12)]  # 6 pages of 2000
    (tmp_path / "first.map").write_text(map_text(2000, first))
    run_faultfs("pagemap", "set", tag, str(tmp_path / "first.map"), check=True)
    shown = run_faultfs("pagemap", "show", tag, check=True).stdout
    assert "pages     6" in shown and "page_size 2000" in shown
    assert page_names(tag) == [f"page:{i}" for i in range(6)]
    old = [read(os.path.join(tag, f"page:{i}")) for i in range(6)]
    assert old == model_pages(2000, first, blobs)
    os.stat(os.path.join(tag, "page:5"))  # the kernel now holds entries for every page

    # Rewritten within the attribute timeout, so only the explicit invalidation can make the
    # kernel drop its cached page data and entries.
    second = [("chunk_11", 3, 0, 1500), ("chunk_0", 0, 2500, 500)]  # 2 pages of 2000
    write_pagemap(tag, map_text(2000, second))
    new = model_pages(2000, second, blobs)
    assert read(os.path.join(tag, "page:0")) == new[0] != old[0]  # not the kernel's old copy
    assert read(os.path.join(tag, "page:1")) == new[1]
    assert errno_of(os.stat, os.path.join(tag, "page:5")) == errno.ENOENT
    assert page_names(tag) == ["page:0", "page:1"]
    assert run_faultfs("pagemap", "show", tag, "--raw", check=True).stdout == map_text(2000, second)

    m.umount()
    again = mounter(store=m.store)  # remount from the store alone
    tag = again.tag("field")
    assert page_names(tag) == ["page:0", "page:1"]
    assert read(os.path.join(tag, ".pagemap")) == map_text(2000, second).encode()
    assert read(os.path.join(tag, "page:0")) == new[0]
    assert read(os.path.join(tag, "page:1")) == new[1]


def test_unreadable_slices_fail_the_read_with_eio(mounter, sample, tmp_path):
    src = sample(10 * CS)
    data = read(src)
    store = str(tmp_path / "store")
    BlobStore(store).put("field", "notes", b"hello, pages", flags=FLAG_DIRTY)
    m = mounter(src, store=store, args=CHUNKED)
    tag = m.tag("field")
    write_pagemap(tag, map_text(100, [
        ("notes", 7, 10, 5),           # page 0: a plain blob of the tag, from the store
        ("chunk_0", 0, 20, 10),
        ("nothere", 0, 100, 10),       # page 1: a blob that does not exist
        ("chunk_8", 0, 200, 100),      # page 2: a chunk the source will no longer have
        ("chunk_1", 4090, 300, 20),    # page 3: a slice running past its blob's end
    ]))
    assert read(os.path.join(tag, "page:0")) == bytes(10) + b"pages" + bytes(5) + data[:10] + bytes(70)
    assert errno_of(read, os.path.join(tag, "page:1")) == errno.EIO
    assert errno_of(read, os.path.join(tag, "page:3")) == errno.EIO
    os.truncate(src, 5 * CS)  # the source changes under the mount: faults fail
    assert errno_of(read, os.path.join(tag, "page:2")) == errno.EIO
    c = m.counters()
    assert c["page_errors"] >= 3 and c["fault_errors"] >= 1  # the kernel may retry a failed read


@pytest.mark.parametrize("page_size", [3000, 10_000, 1 << 20])
def test_page_size_identity_pages_are_the_source(mounter, sample, tmp_path, page_size):
    src = sample(25 * CS + 1234)  # 103_634 bytes: no page size here divides it
    data = read(src)
    m = mounter(src, args=[*CHUNKED, "--page-size", str(page_size)])
    tag = m.tag("field")
    n = -(-len(data) // page_size)
    assert page_names(tag) == [f"page:{i}" for i in range(n)]
    pages = b"".join(read(os.path.join(tag, f"page:{i}")) for i in range(n))
    assert pages == data + bytes(n * page_size - len(data))
    assert pread(os.path.join(tag, f"page:{n - 1}"), 0, page_size) == pages[-page_size:]
    assert m.counters()["page_errors"] == 0
