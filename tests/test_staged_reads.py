"""Staged reads through io_uring (``tiers/uring.py``) against the blocking path, on the same
store: the same verified bytes for any offset and size, a damaged block re-faulted, the
fallback when the ring is off or cannot be set up, many readers through a real mount.

The engine-level tests compare the ring with the blocking path of the same ``LocalTier``
(``use_ring``) over one store; the mount tests check from outside that the daemon's reads
went through its ring (``/proc/PID/fdinfo`` of its io_uring descriptor counts the entries
it submitted)."""

from __future__ import annotations

import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import trio
import trio.lowlevel

from faultfs.store.blobfile import HEADER_LEN, block_size_for
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import ctx_for, engine_for, make_source, payload
from faultfs.tiers import uring

KiB, MiB = 1 << 10, 1 << 20


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def ring_missing_reason() -> str | None:
    ring = uring.open_ring()
    if ring is None:
        return "io_uring is not usable here (see the log line of uring.open_ring)"
    ring.close()
    return None


needs_ring = pytest.mark.skipif(ring_missing_reason() is not None,
                                reason=ring_missing_reason() or "")


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def staged_engine(store, data: bytes, chunk: int, **config):
    """An engine over ``data`` with every blob staged, then a fresh one over the same store
    (nothing open, nothing in memory): its reads come from the blob files."""
    make_source(data)
    eng = engine_for(store, memory_mb=0, prefetch_mb=0, **config)
    tag = eng.register(ctx_for(chunk_size=chunk))
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    eng2 = engine_for(store, memory_mb=0, prefetch_mb=0, **config)
    [tag2] = eng2.recover()
    eng2.tiers.local.block_when_idle = False  # every read it can take goes through the ring
    return eng2, tag2


def drop_store_cache(store: BlobStore) -> None:
    """Push the blob files out of the page cache (so reads really go to the disk)."""
    for tag in os.listdir(os.path.join(store.root, "tags")):
        directory = os.path.join(store.root, "tags", tag)
        for name in os.listdir(directory):
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def edge_ranges(chunk: int, count: int, seed: int) -> list[tuple[int, int, int]]:
    """``(blob, offset, size)``: block boundaries, the blob's end, past the end, random."""
    bs = block_size_for(chunk)
    rng = random.Random(seed)
    out = []
    for index in (0, 1, 2):
        for off in (0, 1, bs - 1, bs, bs + 1, 2 * bs - 7, chunk - bs, chunk - 1):
            for size in (1, 7, 4 * KiB, bs, bs + 1, 3 * bs + 5, 64 * KiB, chunk):
                if 0 <= off < chunk:
                    out.append((index, off, size))
    for _ in range(count):
        out.append((rng.randrange(3), rng.randrange(chunk), rng.randrange(1, 200 * KiB)))
    return out


@needs_ring
@pytest.mark.parametrize("punt", [True, False], ids=["worker", "inline"])
@pytest.mark.parametrize("chunk", [1 * MiB, 300 * KiB + 123, 40 * KiB])
def test_the_ring_serves_the_same_verified_bytes_as_the_blocking_path(store, chunk, punt):
    data = payload(3 * chunk - 1000)  # a short, zero-filled last blob
    eng, tag = staged_engine(store, data, chunk, uring_punt=punt)
    full = data + bytes(3 * chunk - len(data))
    local = eng.tiers.local
    ranges = edge_ranges(chunk, 300, seed=chunk)

    async def read_all(use_ring: bool) -> list[bytes]:
        local.use_ring = use_ring
        out = []
        for index, off, size in ranges:
            out.append(bytes(await eng.read_blob(tag, index, off, size)))
        return out

    drop_store_cache(store)
    through_ring = trio.run(read_all, True)
    reader = local._reader
    assert reader is not None and reader.submitted > 0, "the reads went through the ring"
    assert reader._read_flags == (uring.SQE_ASYNC if punt else 0)
    drop_store_cache(store)
    blocking = trio.run(read_all, False)
    expected = [full[i * chunk + off:i * chunk + min(off + size, chunk)] for i, off, size in ranges]
    assert through_ring == expected
    assert blocking == expected
    assert eng.stats.counters["faults"] == 0, "every read was a hit"


@needs_ring
@pytest.mark.parametrize("punt", [True, False], ids=["worker", "inline"])
def test_concurrent_ring_reads_of_one_blob_and_many(store, punt):
    chunk = 256 * KiB
    data = payload(16 * chunk)
    eng, tag = staged_engine(store, data, chunk, uring_punt=punt)
    rng = random.Random(7)
    ranges = [(rng.randrange(16), rng.randrange(chunk), rng.randrange(1, 70 * KiB))
              for _ in range(400)]
    got: dict[int, bytes] = {}

    async def one(i: int, index: int, off: int, size: int) -> None:
        got[i] = bytes(await eng.read_blob(tag, index, off, size))

    async def main():
        async with trio.open_nursery() as nursery:
            for i, r in enumerate(ranges):
                nursery.start_soon(one, i, *r)

    drop_store_cache(store)
    trio.run(main)
    for i, (index, off, size) in enumerate(ranges):
        assert got[i] == data[index * chunk + off:index * chunk + min(off + size, chunk)]
    assert eng.tiers.local._reader.submitted >= 16  # opens and reads through the ring


@needs_ring
@pytest.mark.parametrize("opened", [False, True], ids=["first-read", "blob-open"])
def test_a_damaged_block_read_through_the_ring_is_refaulted(store, opened):
    chunk = 256 * KiB
    data = payload(3 * chunk)
    eng, tag = staged_engine(store, data, chunk)
    if opened:  # the blob is open (a header read and a block verified) before the damage
        assert bytes(trio.run(eng.read_blob, tag, 1, 0, 100)) == data[chunk:chunk + 100]
    src_reads = make_source(data).reads  # the same bytes, a fresh read counter
    path = store.blob_path("t", "chunk_1")
    with open(path, "r+b") as f:
        f.seek(HEADER_LEN + 5 * block_size_for(chunk) + 3)
        f.write(b"\xff\x00\xfe")
        f.flush()
        os.fsync(f.fileno())  # written back, so dropping the page cache drops it
    drop_store_cache(store)
    bs = block_size_for(chunk)
    got = trio.run(eng.read_blob, tag, 1, 5 * bs, 4 * KiB)
    assert bytes(got) == data[chunk + 5 * bs:chunk + 5 * bs + 4 * KiB]
    c = eng.stats.counters
    assert c["corrupt_blobs_dropped"] == 1 and c["faults"] == 1
    assert make_source(data).reads == src_reads == 0 or c["source_reads"] == 1
    assert eng.tiers.local._reader.submitted > 0
    # the re-faulted copy is staged again and serves the next read from the store
    assert bytes(trio.run(eng.read_blob, tag, 1, 5 * bs, 4 * KiB)) == got


def test_a_reader_that_found_a_blob_gone_keeps_the_copy_stored_meanwhile(store, monkeypatch):
    """Reader B opens a staged blob just after another reader found it damaged and removed
    it; before B's answer reaches the trio thread, the other reader's re-fault stores a good
    copy. B must not unstage that copy: it did, and then B faulted the blob from the source
    a second time (the engine's model test caught it under load). The caller looks again."""
    import threading

    chunk = 256 * KiB
    data = payload(2 * chunk)
    eng, tag = staged_engine(store, data, chunk)
    tier = eng.tiers.local
    tier.inline_read = 0  # the blocking path: its open runs on a pool thread
    key = (tag.id, 1)
    opened, go_on = threading.Event(), threading.Event()
    real = tier._open_and_read

    def slow_open(*args):
        out = real(*args)  # finds the file gone
        opened.set()
        go_on.wait(10)
        return out

    monkeypatch.setattr(tier, "_open_and_read", slow_open)
    os.unlink(store.blob_path("t", "chunk_1"))  # the other reader's discard
    got = {}

    async def main():
        async with trio.open_nursery() as nursery:
            async def reader_b():
                got["b"] = await tier.get(key, 0, 100)
            nursery.start_soon(reader_b)
            await trio.to_thread.run_sync(opened.wait, 10)
            monkeypatch.setattr(tier, "_open_and_read", real)
            await tier.put(key, memoryview(data[chunk:2 * chunk]))  # its re-fault's copy
            go_on.set()

    trio.run(main)
    assert got["b"] is None  # B's own open found nothing: its caller looks again ...
    assert tier.contains(key), "... and finds the copy stored meanwhile, still staged"
    assert bytes(trio.run(tier.get, key, 0, 100)) == data[chunk:chunk + 100]
    assert eng.stats.counters["corrupt_blobs_dropped"] == 0


def test_with_the_ring_off_the_blocking_path_serves_the_same(store):
    chunk = 300 * KiB + 123
    data = payload(3 * chunk)
    eng, tag = staged_engine(store, data, chunk, uring="off")
    assert eng.tiers.local.use_ring is False
    ranges = edge_ranges(chunk, 100, seed=3)

    async def main():
        return [bytes(await eng.read_blob(tag, i, off, size)) for i, off, size in ranges]

    drop_store_cache(store)
    assert trio.run(main) == [data[i * chunk + off:i * chunk + min(off + size, chunk)]
                              for i, off, size in ranges]
    assert eng.tiers.local._reader is None


def test_a_ring_that_cannot_be_set_up_falls_back_with_a_log_line(store, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise uring.RingUnavailable("io_uring_setup failed: Operation not permitted")

    monkeypatch.setattr(uring, "Ring", refuse)
    monkeypatch.setattr(uring, "_told", set())
    chunk = 64 * KiB
    data = payload(2 * chunk)
    eng, tag = staged_engine(store, data, chunk)
    eng.tiers.local.use_ring = True
    with caplog.at_level(logging.INFO, logger="faultfs.tiers"):
        got = trio.run(eng.read_blob, tag, 1, 100, 5000)
    assert bytes(got) == data[chunk + 100:chunk + 5100]
    assert eng.tiers.local.use_ring is False and eng.tiers.local._reader is None
    assert any("io_uring is not available" in r.getMessage() for r in caplog.records)


@needs_ring
def test_a_ring_is_made_per_trio_run_and_closed_with_the_tier(store):
    chunk = 64 * KiB
    data = payload(2 * chunk)
    eng, tag = staged_engine(store, data, chunk)
    local = eng.tiers.local
    assert bytes(trio.run(eng.read_blob, tag, 0, 0, 10)) == data[:10]
    first = local._reader
    assert bytes(trio.run(eng.read_blob, tag, 1, 0, 10)) == data[chunk:chunk + 10]
    assert local._reader is not first and first.closed
    eng.close()
    assert local._reader is None


# -- through a real mount -----------------------------------------------------------------------

def ring_submissions(pid: int) -> int | None:
    """Entries the daemon submitted to its io_uring (``SqHead`` of its ring), or None when
    it has no ring open."""
    total = None
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[io_uring]":
                continue
            with open(f"/proc/{pid}/fdinfo/{fd}") as f:
                info = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        total = (total or 0) + int(info["SqHead"].strip())
    return total


def staged_mount(mounter, sample, tmp_path, size: int, env: dict | None = None):
    """A mount of a random source with every blob staged, remounted (nothing open or in
    memory), its store files out of the page cache."""
    src = sample(size)
    store = str(tmp_path / "store")
    m = mounter(src, store=store, env=env)
    assert read(os.path.join(m.tag("field"), "field.bin")) == read(src)
    m.umount()
    m = mounter(store=store, env=env, args=["--memory-mb", "0", "--prefetch-mb", "0"])
    drop_store_cache(BlobStore(store))
    return src, m


def flip_a_byte(store: str, blob: str, at: int) -> None:
    path = BlobStore(store).blob_path("field", blob)
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, HEADER_LEN + at)
        os.pwrite(fd, bytes([old[0] ^ 0x5A]), HEADER_LEN + at)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.mount
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "ring-off"])
def test_a_flipped_byte_in_a_staged_blob_is_refaulted_through_a_mount(
        mounter, sample, tmp_path, ring):
    # the engine's staged reads: the fast read path (tests/test_fast_reads.py) kept out
    env = {"FAULTFS_URING": "always" if ring else "0", "FAULTFS_FAST_READ": "0"}
    src, m = staged_mount(mounter, sample, tmp_path, 4 * MiB + 777, env)
    data = read(src)
    at = MiB + 3 * block_size_for(MiB) + 100  # inside blob chunk_1
    flip_a_byte(m.store, "chunk_1", at - MiB)
    view = os.path.join(m.tag("field"), "field.bin")
    fd = os.open(view, os.O_RDONLY)
    try:
        assert os.pread(fd, 4 * KiB, at - 100) == data[at - 100:at - 100 + 4 * KiB]
        assert os.pread(fd, 4 * KiB, 3 * MiB) == data[3 * MiB:3 * MiB + 4 * KiB]
    finally:
        os.close(fd)
    c = m.counters()
    assert c["corrupt_blobs_dropped"] == 1
    assert c["faults"] == 1 and c["source_reads"] == 1, "only the damaged blob re-faulted"
    submitted = ring_submissions(m.pid)
    if ring and ring_missing_reason() is None:
        assert submitted and submitted > 3, "the daemon read through its io_uring"
        assert c["ring_reads"] > 0
    else:
        assert not submitted, "FAULTFS_URING=0: no ring"
        assert c["ring_reads"] == 0


def _random_reader(path: str, size: int, count: int, seed: int) -> list[tuple[int, bytes]]:
    rng = random.Random(seed)
    fd = os.open(path, os.O_RDONLY)
    out = []
    try:
        for _ in range(count):
            off = rng.randrange(size - 1)
            n = rng.choice((4 * KiB, 1, 4 * KiB + 3, 100 * KiB))
            out.append((off, os.pread(fd, n, off)))
    finally:
        os.close(fd)
    return out


@pytest.mark.mount
@pytest.mark.parametrize("ring", ["on", "always", "0"])
def test_many_concurrent_readers_through_a_mount_read_the_right_bytes(
        mounter, sample, tmp_path, ring):
    env = {"FAULTFS_URING": ring, "FAULTFS_FAST_READ": "0"}  # the engine's reads, not the C path
    size = 12 * MiB + 12345
    src, m = staged_mount(mounter, sample, tmp_path, size, env)
    data = read(src)
    view = os.path.join(m.tag("field"), "field.bin")
    readers = 12  # threads: os.pread lets go of the GIL, so their reads are in flight at once
    with ThreadPoolExecutor(readers) as pool:
        results = list(pool.map(lambda seed: _random_reader(view, size, 150, seed),
                                range(readers)))
    for got in results:
        for off, piece in got:
            assert piece == data[off:off + len(piece)], f"bytes at {off}"
    c = m.counters()
    assert c["faults"] == 0 and c["corrupt_blobs_dropped"] == 0
    submitted = ring_submissions(m.pid)
    if ring != "0" and ring_missing_reason() is None:
        # "on": the ring when other requests wait (12 readers: most of the time)
        assert submitted and submitted >= 100
    else:
        assert not submitted


def test_opening_ahead_a_large_mostly_unstaged_tag_never_holds_the_serving_thread(tmp_path):
    """``LocalTier.open_ahead`` (the fast read path's, when a tag is enabled) scans the tag's
    staged bitmap a piece at a time between checkpoints: other tasks run all along."""
    store = BlobStore(str(tmp_path / "store"))
    blobs = 1 << 27  # a 16 MiB bitmap
    make_source(b"\x01", url="mem://sparse", size=blobs)
    eng = engine_for(store)
    tag = eng.register(ctx_for("mem://sparse", tag="sparse", chunk_size=1))
    local = eng.tiers.local
    local.mark((tag.id, blobs - 1), True)  # one staged blob, at the end (its file is missing)
    ticks = 0

    async def main() -> int:
        nonlocal ticks

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            opened = await local.open_ahead(tag.id)
            nursery.cancel_scope.cancel()
        return opened

    try:
        assert trio.run(main) == 0, "a missing file is not opened"
        assert ticks >= 100, f"the scan let other tasks run only {ticks} times"
    finally:
        eng.close()
