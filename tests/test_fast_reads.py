"""The fast read path (``faultfs/fuse/fastread.py``, ``_fastread.c``) through real mounts: staged
reads answered by its threads are the source's bytes through every name, whatever the offset
and size; a write to a tag stops it serving that tag before the write is answered; a block
damaged after its blob was opened is re-faulted by the engine, never served; eviction under
it, the switch, and an unmount with reads in flight.

Every case checks from outside that the path really served reads (``fast_reads`` in the
daemon's counters) — or, switched off, that it served none."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from faultfs.fuse.lowlevel import native
from faultfs.store.blobfile import HEADER_LEN, block_size_for
from faultfs.store.blobstore import BlobStore
from tests.conftest import run_faultfs
from tests.test_fuse_fastwait import _drop as drop_cache
from tests.test_staged_reads import drop_store_cache, read, staged_mount

KiB, MiB = 1 << 10, 1 << 20

pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(native is None, reason="the compiled fast read path "
                       "(faultfs/fuse/_fastread.c) is not built in this install"),
]


def random_reads(path: str, size: int, count: int, seed: int) -> list[tuple[int, bytes]]:
    rng = random.Random(seed)
    fd = os.open(path, os.O_RDONLY)
    out = []
    try:
        for _ in range(count):
            off = rng.randrange(size)
            n = rng.choice((1, 4 * KiB, 4 * KiB + 3, 64 * KiB, 300 * KiB))
            out.append((off, os.pread(fd, n, off)))
    finally:
        os.close(fd)
    return out


def read_rounds(view: str, size: int, data: bytes, rounds: int, count: int, *,
                after=None) -> None:
    """``rounds`` rounds of 8 threads' random reads of ``view``, each piece compared with
    ``data``; the view's cached pages (and ``after()``) dropped after each round."""
    for rnd in range(rounds):
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda s: random_reads(view, size, count, s),
                                    range(rnd * 8, rnd * 8 + 8)))
        for got in results:
            for off, piece in got:
                assert piece == data[off:off + len(piece)], f"view bytes at {off}"
        drop_cache(view)
        if after is not None:
            after()


def test_staged_reads_through_the_view_and_the_chunks_are_the_sources_bytes(
        mounter, sample, tmp_path):
    size = 10 * MiB + 4321  # a short last chunk: its tail reads as zeros through chunk_10
    src, m = staged_mount(mounter, sample, tmp_path, size)
    data = read(src)
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    read_rounds(view, size, data, 2, 120)
    for index in (0, 3, 10):
        chunk = os.path.join(tag, f"chunk_{index}")
        want = data[index * MiB:(index + 1) * MiB].ljust(MiB, b"\0")
        for _ in range(2):
            drop_cache(chunk)
            assert read(chunk) == want, f"chunk_{index}"
    c = m.counters()
    assert c["fast_reads"] > 100, c
    assert c["faults"] == 0 and c["corrupt_blobs_dropped"] == 0
    assert c["reads"] >= c["fast_reads"] and c["bytes_served"] > 0


def test_a_clones_staged_reads_are_served_here_from_its_parents_blobs(
        mounter, sample, tmp_path):
    """A clone's clean chunks are its parent's blobs (published under the parent's id): its
    reads are served here too. A write to the parent after the clone changes neither what
    the clone reads nor where; a write to the clone stops the path for the clone."""
    src, m = staged_mount(mounter, sample, tmp_path, 4 * MiB)
    data = read(src)
    run_faultfs("clone", m.tag("field"), "c", check=True)
    view = os.path.join(m.tag("c"), "field.bin")
    at = MiB + 5000  # inside chunk_1
    want = data[at:at + 4 * KiB]
    fd = os.open(view, os.O_RDONLY)
    try:
        for _ in range(3):
            assert os.pread(fd, 4 * KiB, at) == want
            drop_cache(view)
        served = m.counters()["fast_reads"]
        assert served >= 1
        with open(os.path.join(m.tag("field"), "chunk_1"), "r+b") as w:
            w.seek(at - MiB)
            w.write(os.urandom(4 * KiB))
        for _ in range(3):
            assert os.pread(fd, 4 * KiB, at) == want, "the parent's later write is its own"
            drop_cache(view)
        assert m.counters()["fast_reads"] > served
        served = m.counters()["fast_reads"]
        with open(os.path.join(m.tag("c"), "chunk_3"), "r+b") as w:
            w.write(b"clone")
        for _ in range(3):
            assert os.pread(fd, 4 * KiB, at) == want
            drop_cache(view)
        assert m.counters()["fast_reads"] == served, "nothing of a written tag is served here"
    finally:
        os.close(fd)
    assert m.counters()["source_reads"] == 0


def test_a_write_stops_the_fast_path_for_its_tag_before_it_is_answered(
        mounter, sample, tmp_path):
    size = 4 * MiB
    src, m = staged_mount(mounter, sample, tmp_path, size)
    data = bytearray(read(src))
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    at = MiB + 5000  # inside chunk_1
    fd = os.open(view, os.O_RDONLY)
    try:
        for _ in range(3):  # chunk_1 opened, then served here
            assert os.pread(fd, 4 * KiB, at) == data[at:at + 4 * KiB]
            drop_cache(view)
        served = m.counters()["fast_reads"]
        assert served >= 1
        new = os.urandom(4 * KiB)
        with open(os.path.join(tag, "chunk_1"), "r+b") as w:
            w.seek(at - MiB)
            w.write(new)
        data[at:at + len(new)] = new
        for _ in range(3):
            drop_cache(view)
            assert os.pread(fd, 4 * KiB, at) == new, "the view reads the write back"
            assert os.pread(fd, 4 * KiB, 3 * MiB) == data[3 * MiB:3 * MiB + 4 * KiB]
        chunk = os.path.join(tag, "chunk_1")
        drop_cache(chunk)
        assert read(chunk)[at - MiB:at - MiB + len(new)] == new
        assert m.counters()["fast_reads"] == served, "nothing of a written tag is served here"
    finally:
        os.close(fd)
    # a reset takes the tag back to the source's bytes; reopened, it is served here again
    run_faultfs("reset", tag, check=True)
    src_bytes = read(src)
    for _ in range(3):
        drop_cache(view)
        fd = os.open(view, os.O_RDONLY)
        try:
            assert os.pread(fd, 4 * KiB, at) == src_bytes[at:at + 4 * KiB]
        finally:
            os.close(fd)
    assert m.counters()["fast_reads"] > served
    assert read(src) == src_bytes, "the source is never written"


def test_a_block_damaged_after_its_blob_was_opened_is_refaulted_not_served(
        mounter, sample, tmp_path):
    size = 4 * MiB
    src, m = staged_mount(mounter, sample, tmp_path, size)
    data = read(src)
    view = os.path.join(m.tag("field"), "field.bin")
    at = 2 * MiB + 3 * block_size_for(MiB) + 100  # in chunk_2, its fourth block
    fd = os.open(view, os.O_RDONLY)
    try:
        for _ in range(2):
            assert os.pread(fd, 4 * KiB, at) == data[at:at + 4 * KiB]
            drop_cache(view)
        assert m.counters()["fast_reads"] >= 1, "chunk_2 is open and served here"
        path = BlobStore(m.store).blob_path("field", "chunk_2")
        raw = os.open(path, os.O_RDWR)  # the same file the path holds open: flipped in place
        try:
            old = os.pread(raw, 1, HEADER_LEN + at - 2 * MiB)
            os.pwrite(raw, bytes([old[0] ^ 0x5A]), HEADER_LEN + at - 2 * MiB)
            os.fsync(raw)
            os.posix_fadvise(raw, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(raw)
        drop_cache(view)
        assert os.pread(fd, 4 * KiB, at) == data[at:at + 4 * KiB], "never the damaged bytes"
        drop_cache(view)
        assert os.pread(fd, 4 * KiB, at) == data[at:at + 4 * KiB]
    finally:
        os.close(fd)
    c = m.counters()
    assert c["corrupt_blobs_dropped"] == 1
    assert c["faults"] == 1, "the damaged blob was faulted again, and only it"


def test_blobs_evicted_under_the_fast_path_are_read_again_from_the_source(
        mounter, sample, tmp_path):
    size = 24 * MiB
    src = sample(size)
    data = read(src)
    store = str(tmp_path / "store")
    m = mounter(src, store=store, args=["--cache-size", str(6 * MiB), "--memory-mb", "0",
                                        "--prefetch-mb", "0"])
    view = os.path.join(m.tag("field"), "field.bin")
    read_rounds(view, size, data, 3, 60, after=lambda: drop_store_cache(BlobStore(store)))
    c = m.counters()
    assert c["evicted"] > 0 and c["fast_reads"] > 0, c


def test_switched_off_no_read_is_answered_by_the_fast_path(mounter, sample, tmp_path):
    env = {"FAULTFS_FAST_READ": "0"}
    size = 3 * MiB + 5
    src, m = staged_mount(mounter, sample, tmp_path, size, env)
    data = read(src)
    view = os.path.join(m.tag("field"), "field.bin")
    for _ in range(2):
        for off, piece in random_reads(view, size, 50, 1):
            assert piece == data[off:off + len(piece)]
        drop_cache(view)
    assert m.counters()["fast_reads"] == 0


def test_a_daemon_told_to_stop_with_readers_in_flight_ends(mounter, sample, tmp_path):
    size = 8 * MiB
    src, m = staged_mount(mounter, sample, tmp_path, size)
    data = read(src)
    view = os.path.join(m.tag("field"), "field.bin")
    stop = threading.Event()
    wrong: list[int] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            fd = os.open(view, os.O_RDONLY)
        except OSError:
            return
        try:
            while not stop.is_set():
                off = rng.randrange(size - 4 * KiB)
                try:
                    piece = os.pread(fd, 4 * KiB, off)
                except OSError:
                    return  # the mount went away under it
                if piece and piece != data[off:off + len(piece)]:
                    wrong.append(off)
        finally:
            try:
                os.close(fd)
            except OSError:
                pass  # ENOTCONN: the connection is gone

    threads = [threading.Thread(target=reader, args=(s,), daemon=True) for s in range(8)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    assert m.counters()["fast_reads"] > 0
    os.kill(m.pid, signal.SIGTERM)  # the daemon unmounts itself, its readers busy
    assert m.wait_gone(60), "the daemon ended"
    stop.set()
    for t in threads:
        t.join(10)
    assert not wrong, f"wrong bytes at {wrong[:5]}"

