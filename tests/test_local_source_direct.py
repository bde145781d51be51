"""Local sources read around the page cache (``sources/local.py``): large reads of an
uncached range go through ``O_DIRECT`` and return the same bytes as the page-cache path, at
any offset and at the file's end; a cached range, a small read, or ``direct=False`` take the
page cache; the mount's settings (``FAULTFS_SOURCE_DIRECT``, ``FAULTFS_URING``) reach the
source and the store tier."""

from __future__ import annotations

import os
import random

import pytest

from faultfs.config import Config
from faultfs.errors import InvalidInput
from faultfs.sources import SourceOptions, open_source
from faultfs.sources.local import DIRECT_MIN, LocalFileSource, cached_pages

KiB, MiB = 1 << 10, 1 << 20


def uncached_file(path, size: int, seed: int = 1) -> bytes:
    data = random.Random(seed).randbytes(size)
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return data


def direct_missing_reason(path) -> str | None:
    src = LocalFileSource(str(path), str(path))
    try:
        if not src.direct:
            return "O_DIRECT or cachestat is not available here"
        if cached_pages(src._fd, 0, 4096) is None:
            return "the kernel has no cachestat (Linux >= 6.5)"
        return None
    finally:
        src.close()


@pytest.fixture
def big(tmp_path):
    path = tmp_path / "big.bin"
    data = uncached_file(path, 6 * MiB + 12345)
    reason = direct_missing_reason(path)
    if reason:
        pytest.skip(reason)
    return path, data


def test_an_uncached_large_read_skips_the_page_cache_and_returns_the_same_bytes(big):
    path, data = big
    src = LocalFileSource(str(path), str(path))
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            for off, size in [(0, MiB), (MiB + 1, 2 * MiB - 3), (3 * MiB + 4095, DIRECT_MIN)]:
                assert bytes(src.pread(off, size)) == data[off:off + size]
            assert src.direct_reads == 3
            # the bytes came from the disk into our buffer, not through the page cache
            assert cached_pages(fd, 0, 4 * MiB + 4096) == 0
        finally:
            os.close(fd)
        # the file's short tail: a read past the end returns what is there
        tail = 5 * MiB + 7
        assert bytes(src.pread(tail, 2 * MiB)) == data[tail:]
        assert src.direct_reads == 4
    finally:
        src.close()


def test_a_cached_range_or_a_small_read_takes_the_page_cache(big):
    path, data = big
    with open(path, "rb") as f:
        f.read(2 * MiB)  # now in the page cache
    src = LocalFileSource(str(path), str(path))
    try:
        assert bytes(src.pread(0, 2 * MiB)) == data[:2 * MiB]
        assert bytes(src.pread(4 * MiB, 64 * KiB)) == data[4 * MiB:4 * MiB + 64 * KiB]
        assert src.direct_reads == 0
    finally:
        src.close()


def test_direct_off_never_skips_the_page_cache(big):
    path, data = big
    src = open_source(str(path), SourceOptions(local_direct=False))
    try:
        assert isinstance(src, LocalFileSource) and not src.direct
        assert bytes(src.pread(MiB, 3 * MiB)) == data[MiB:4 * MiB]
        assert src.direct_reads == 0
    finally:
        src.close()


def test_a_source_changed_after_a_direct_read_is_refused(big):
    path, data = big
    src = LocalFileSource(str(path), str(path))
    try:
        assert bytes(src.pread(0, MiB)) == data[:MiB]
        with open(path, "r+b") as f:
            f.write(b"x")
        with pytest.raises(Exception, match="changed under the mount"):
            src.pread(2 * MiB, MiB)
    finally:
        src.close()


def test_the_settings_reach_the_mount_from_the_environment():
    config = Config.build(env={"FAULTFS_SOURCE_DIRECT": "0", "FAULTFS_URING": "0"})
    assert config.source_direct is False and config.uring == "off"
    config = Config.build(env={"FAULTFS_URING": "always"})
    assert config.source_direct is True and config.uring == "always"
    assert Config.build(env={}).uring == "on"
    assert Config.build(env={}).uring_punt is True
    assert Config.build(env={"FAULTFS_URING_PUNT": "0"}).uring_punt is False
    with pytest.raises(InvalidInput, match="FAULTFS_URING must be one of"):
        Config.build(env={"FAULTFS_URING": "sometimes"})


def test_prefetch_reads_a_range_into_the_page_cache_in_the_background(big):
    """``prefetch`` (a shuffled stream's advice for its next windows' pieces) brings the
    range, and not the rest of the file, into the page cache without reading it itself; a
    range past the end and a closed source are advice that does nothing."""
    import time

    from faultfs.stream.shards import ShardFile

    path, data = big
    file = ShardFile(LocalFileSource(str(path), str(path)), len(data))
    fd = os.open(path, os.O_RDONLY)
    try:
        off, size = 2 * MiB, 256 * KiB
        assert cached_pages(fd, off, size) == 0
        file.prefetch(off, size)
        deadline = time.monotonic() + 10
        while cached_pages(fd, off, size) != size // 4096 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cached_pages(fd, off, size) == size // 4096
        assert cached_pages(fd, 4 * MiB, 2 * MiB) == 0
        file.prefetch(len(data) - 100, 10 * MiB)  # past the end: clipped
        file.prefetch(len(data) + 1, 4096)
        assert file.tell() == 0 and file.read(16) == data[:16]
    finally:
        os.close(fd)
        file.close()
    file.prefetch(0, 4096)  # closed: nothing
