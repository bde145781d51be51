"""Runs that land blob by blob (an S3-like source: ``receives_in_pieces``), through the
engine: exact bytes and staged blobs across connections dropped inside a piece and a short
last blob, one store write per blob, the data budget back to nothing after; with a store
slower than the source, what the runs hold stays within ``--memory-mb`` and is counted; and
a local source's runs (slices of one buffer) keep serving a sequential reader from memory.

The source is a real ``FsspecSource`` over a reader that fills through the S3 path's own
``fill`` (``sources/s3.py``), so ``Pieces`` and their edges are the production code's."""

from __future__ import annotations

import collections
import threading
import time

import pytest
import trio

import assimilators.binary
from faultfs import buffers
from faultfs.core.context import FaultContext
from faultfs.sources.objects import ObjectStat
from faultfs.sources.remote import FsspecSource
from faultfs.sources.retry import RetryPolicy, Transient
from faultfs.sources.s3 import fill
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import engine_for, payload
from faultfs.tiers.multilevel import STORE_PAUSE_POLL_S

MiB = 1 << 20
URL = "s3://bucket/obj.bin"


class PieceReader:
    """An object store's reader: ``read_into`` fills as the S3 path does, dropping the
    connection once at each offset of ``drops``, each receive ``pace`` s after the last."""

    def __init__(self, data: bytes, drops: set[int] = frozenset(), pace: float = 0.0) -> None:
        self.data = data
        self.drops = set(drops)
        self.pace = pace
        self.lock = threading.Lock()

    def stat(self) -> ObjectStat:
        return ObjectStat(len(self.data), "etag:x", 1_700_000_000.0, etag='"x"')

    def read(self, pin, start, end):
        return self.data[start:end]

    def read_into(self, pin, start, end, buf, progress=None, piece=8 * MiB):
        pos = start

        def readinto(view):
            nonlocal pos
            time.sleep(self.pace)
            with self.lock:
                drop = min((d for d in self.drops if pos <= d < pos + len(view)), default=None)
                if drop is not None:
                    self.drops.discard(drop)
            if drop is not None:
                view[:drop - pos] = self.data[pos:drop]
                pos = drop
                raise Transient(f"connection reset at {drop}")
            view[:] = self.data[pos:pos + len(view)]
            pos += len(view)
            return len(view)

        fill(readinto, buf, progress, piece)


def engine_over(monkeypatch, tmp_path, reader, **config):
    source = FsspecSource(URL, reader, RetryPolicy(attempts=4, base_delay_s=0.0,
                                                   max_delay_s=0.0))
    assert source.receives_in_pieces
    monkeypatch.setattr(assimilators.binary, "open_source", lambda url, options=None: source)
    monkeypatch.setattr(buffers, "POOL", buffers.BufferPool())  # this test's buffers only
    engine = engine_for(BlobStore(str(tmp_path / "store")), **config)
    tag = engine.register(FaultContext(URL, "obj", format="binary", chunk_size=MiB))
    return engine, tag


def read_all(engine, tag, size: int, step: int, *, slow_put: float = 0.0, pace: float = 0.0,
             watch=None) -> tuple[bytes, collections.Counter]:
    """The whole view read in order, ``step`` bytes at a time (``pace`` s apart), the engine
    attached to a nursery as a mount's is; the store writes each blob (counted) after
    ``slow_put`` s."""
    puts: collections.Counter = collections.Counter()
    local = engine.tiers.local
    put = local.put

    async def counted_put(key, data):
        puts[key] += 1
        await trio.sleep(slow_put)
        return await put(key, data)

    local.put = counted_put
    out = bytearray()

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            if watch is not None:
                nursery.start_soon(watch)
            with trio.fail_after(120):
                off = 0
                while off < size:
                    got = await engine.read_view(tag, off, min(step, size - off))
                    out.extend(bytes(got))
                    off += len(got)
                    await trio.sleep(pace)
                while engine.busy:  # noqa: ASYNC110 (the engine has no event for it)
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return bytes(out), puts


@pytest.mark.parametrize("size", [12 * MiB - 4097, 10 * MiB + 1])
def test_runs_in_pieces_are_exact_across_drops_and_store_each_blob_once(
        monkeypatch, tmp_path, size):
    data = payload(size)
    drops = {MiB + 300_000, 3 * MiB - 1, 5 * MiB + (128 << 10) + 7, size - 5}
    engine, tag = engine_over(monkeypatch, tmp_path, PieceReader(data, drops),
                              memory_mb=16, prefetch_mb=16)
    try:
        out, puts = read_all(engine, tag, size, 128 << 10)
        assert out == data
        blobs = tag.layout.num_blobs
        assert puts == {(tag.id, i): 1 for i in range(blobs)}, "each blob stored once"
        assert engine.tiers.budget.in_flight == 0 and not engine.tiers.memory._pins
        for i in range(blobs):  # and staged exactly, zeros only past the object's end
            blob = engine.tiers.local.load_blocking([(tag.id, i)])[0]
            start, end = tag.layout.source_range(i)
            assert bytes(blob[:end - start]) == data[start:end], i
            assert bytes(blob[end - start:]) == bytes(len(blob) - (end - start))
    finally:
        engine.close()


@pytest.mark.parametrize("busy_s", [0.0, 0.03])
def test_a_store_slower_than_the_source_keeps_what_runs_hold_within_the_budget(
        monkeypatch, tmp_path, busy_s):
    """Runs pause between blobs while the store writes fall behind, and a run's landed
    blobs stay counted until it lets go of them: the pooled buffers alive never pass the
    budget (64 MiB at the defaults) by more than a few blobs (62–64 MiB here, against 86–91
    when runs neither paused nor stayed counted), and every blob waiting for its store
    write is in the memory tier, counted. ``busy_s``: a trio thread slow to take the landed
    blobs in (a loaded machine's) must not let a run land more meanwhile (73 MiB when a
    pause looked at the store queue before its own blobs were in it)."""
    size = 96 * MiB
    data = payload(size)
    engine, tag = engine_over(monkeypatch, tmp_path, PieceReader(data))
    worst = collections.Counter()
    if busy_s:  # a trio thread slow to take landed blobs in (a loaded machine's)
        hold = engine.tiers.hold

        def slow_hold(key, data, **kw):
            time.sleep(busy_s)
            return hold(key, data, **kw)

        monkeypatch.setattr(engine.tiers, "hold", slow_hold)

    async def watch():
        tiers, pool = engine.tiers, buffers.POOL
        while True:
            with pool._lock:
                live = sum(len(m) for m in pool._lent if not buffers._unused(m))
            worst["live"] = max(worst["live"], live)
            worst["uncounted"] = max(worst["uncounted"], sum(
                len(d) for k, d in tiers._pending.items() if k not in tiers.memory))
            await trio.sleep(0.002)

    try:
        out, _ = read_all(engine, tag, size, MiB, slow_put=0.6, watch=watch)
        assert out == data
        limit = engine.tiers.budget.limit
        assert limit == 64 * MiB
        assert worst["live"] <= limit + limit // 8, f"{worst['live'] / MiB} MiB alive"
        assert worst["uncounted"] == 0, "a blob waiting for its store write was not counted"
        # a run paused for the store writes never waits for its own blobs' (it did: each
        # stall lasted the pause's whole bound, 10 s, the reader with it)
        assert engine.tiers.store_pauses_cut == 0
        assert engine.tiers.budget.in_flight == 0 and not engine.tiers.memory._pins
    finally:
        engine.close()


def test_a_local_sequential_reader_keeps_reading_its_runs_from_memory(tmp_path):
    """A local source's runs are slices of one buffer, which memory drops together: the
    blob a sequential reader passed is not put first in line to drop (that would drop the
    run's blobs still ahead of the reader with it)."""
    size = 48 * MiB
    data = payload(size)
    src = tmp_path / "obj.bin"
    src.write_bytes(data)
    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=16)
    tag = engine.register(FaultContext(str(src), "obj", format="binary", chunk_size=MiB))
    try:
        out, _ = read_all(engine, tag, size, 128 << 10, pace=0.0005)  # prefetch keeps ahead
        assert out == data
        c = engine.stats.counters
        assert c["hits"] - c["memory_hits"] <= 8, "reads went to the store, not memory"
    finally:
        engine.close()


def test_a_blob_staged_again_takes_its_own_pin_not_its_runs(tmp_path):
    """A blob whose store write the policy skipped, staged again behind a write to it
    (``stage_behind``) while its run still holds it, pins it for that store write: the end
    of the write must not take the run's pin."""
    from faultfs.tiers.base import StoreOutcome

    src = tmp_path / "obj.bin"
    src.write_bytes(payload(4 * MiB))
    engine = engine_for(BlobStore(str(tmp_path / "store")))
    tag = engine.register(FaultContext(str(src), "obj", format="binary", chunk_size=MiB))
    tiers = engine.tiers

    async def skipped(key, data):  # the store policy kept it out (the cache cap)
        return StoreOutcome.SKIPPED_CACHE_CAP

    tiers.local.put = skipped
    key, data = (tag.id, 0), memoryview(bytearray(payload(MiB)))

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            tiers.hold(key, data)  # as a run's ``hand`` does
            tiers.pin(key)
            assert tiers.store_soon(key, data)
            await tiers.wait_stored(key)
            assert tiers.stage_behind(key, data)  # a write's ``stage_clean``
            await trio.sleep(0.05)  # its task starts its store write ...
            while tiers.pending_stores:  # noqa: ASYNC110 (no event for it)
                await trio.sleep(0.01)  # ... which ends
            assert tiers.memory._pins.get(key) == 1, "the run's pin was taken"
            tiers.unpin([key])  # the run ends
            assert not tiers.memory._pins
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        engine.close()


@pytest.mark.parametrize("memory_mb", [64, 128, 256])
def test_a_local_window_and_its_requests_are_what_they_were(tmp_path, memory_mb):
    """Only runs that land blob by blob reach further: a local file's window stays
    ``--prefetch-mb`` (32 MiB by default) within half of the budget, in 2 MiB requests."""
    src = tmp_path / "obj.bin"
    src.write_bytes(payload(4 * MiB))
    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=memory_mb)
    tag = engine.register(FaultContext(str(src), "obj", format="binary", chunk_size=MiB))
    try:
        window = engine.prefetch.window_bytes(tag)
        assert window == 32 * MiB and engine.prefetch.run_blobs(MiB, window) == 2
        assert engine.prefetch.reach == min(64, memory_mb) * MiB  # an S3 tag's
    finally:
        engine.close()


def test_a_reader_slower_than_its_window_reads_it_from_memory(monkeypatch, tmp_path):
    """A reader slower than its prefetch (h5py decodes as it reads) has the whole window
    landed before it gets there; those blobs are older than the ones it just read, and
    least-recently-used order dropped the next ones it needed, each read back from the store
    (about one for each blob faulted, in an h5py read of a 256 MiB dataset; 48 for 40 here,
    and the reader read its own next blob from the store at times)."""
    size = 40 * MiB
    data = payload(size)
    engine, tag = engine_over(monkeypatch, tmp_path, PieceReader(data), memory_mb=16,
                              prefetch_mb=8)
    try:
        out, _ = read_all(engine, tag, size, 256 << 10, pace=0.004)
        assert out == data
        c = engine.stats.counters
        # a few at the window's opening, where its runs in flight each hold a blob of the
        # budget beside what landed: the furthest ahead are dropped and read back later
        assert c["store_readahead"] <= 8, f"{c['store_readahead']} blobs read back"
        assert c["hits"] - c["memory_hits"] <= 1, "the reader's reads went to the store"
    finally:
        engine.close()


def test_a_prefetch_run_pauses_only_when_the_store_queue_is_full(monkeypatch, tmp_path):
    """A run's pause counts the blobs it landed that the trio thread has not taken in yet
    as waiting for the store; with room in the queue it does not wait for the trio thread
    to take them (it did: every blob of a run waited a 2 ms poll, which capped a run of
    64 KiB blobs at 32 MB/s)."""
    cs, blobs = 64 << 10, 64
    data = payload(cs * blobs)
    source = FsspecSource(URL, PieceReader(data), RetryPolicy(attempts=1, base_delay_s=0.0,
                                                              max_delay_s=0.0))
    monkeypatch.setattr(assimilators.binary, "open_source", lambda url, options=None: source)
    monkeypatch.setattr(buffers, "POOL", buffers.BufferPool())
    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=64)
    tag = engine.register(FaultContext(URL, "obj", format="binary", chunk_size=cs))
    pauses: list[float] = []
    wait = engine.tiers.wait_for_store

    def timed(*args):
        started = time.perf_counter()
        wait(*args)
        pauses.append(time.perf_counter() - started)

    monkeypatch.setattr(engine.tiers, "wait_for_store", timed)

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            flights = engine.flights.claim((tag.id, i) for i in range(blobs))
            await engine.faults.fault_run(tag, 0, flights)  # a prefetch's run
            while engine.busy:  # noqa: ASYNC110 (the engine has no event for it)
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert engine.tiers._slot_count > blobs  # the queue never fills
        assert len(pauses) == blobs - 1
        slept = sum(p >= STORE_PAUSE_POLL_S for p in pauses)
        assert slept <= 4, f"{slept} of {len(pauses)} pauses slept a poll"
        for i in range(blobs):
            assert bytes(engine.tiers.local.load_blocking([(tag.id, i)])[0]) == \
                data[i * cs:(i + 1) * cs]
    finally:
        engine.close()


@pytest.mark.parametrize("step", [64 << 10, MiB])
def test_a_prefetched_blob_a_reader_took_from_its_flight_is_kept_as_read(
        monkeypatch, tmp_path, step):
    """Readers that join a prefetch's flight (the kernel's readahead asks for a blob's
    pieces at once, while it lands) take its bytes from the flight, not from memory: the
    blob is kept as read, not as ahead of its readers (it stayed protected, and a fast
    sequential reader's window then dropped blobs it had not read: 8–45 read back from the
    store in a 512 MiB read)."""
    size = 4 * MiB
    data = payload(size)
    engine, tag = engine_over(monkeypatch, tmp_path, PieceReader(data, pace=0.01),
                              memory_mb=16, prefetch_mb=0)
    memory = engine.tiers.memory

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            flights = engine.flights.claim((tag.id, i) for i in range(4))
            nursery.start_soon(engine.faults.fault_run, tag, 0, flights)  # a prefetch's run
            with trio.fail_after(30):
                for off in range(0, 2 * MiB, step):  # blobs 0 and 1, read as they land
                    got = await engine.read_view(tag, off, step)
                    assert bytes(got) == data[off:off + step]
                while engine.busy:  # noqa: ASYNC110 (the engine has no event for it)
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        assert {(tag.id, 0), (tag.id, 1)} & set(memory._ahead) == set()
        assert {(tag.id, 2), (tag.id, 3)} <= set(memory._ahead)  # not read: still ahead
    finally:
        engine.close()


def test_two_slow_readers_share_memory_without_reading_each_others_windows_back(
        monkeypatch, tmp_path):
    """Two readers slower than their windows, of two files, under one budget: the windows
    stop where what all of them have landed fills memory (each window counted alone, two
    overran it, and each dropped the other's landed blobs: 195–232 store reads for 64
    blobs read), and what must go is furthest from its own file's reader (a review)."""
    sizes = {"s3://b/a.bin": 64 * MiB, "s3://b/b.bin": 32 * MiB}
    datas = {url: payload(n) for url, n in sizes.items()}
    sources = {url: FsspecSource(url, PieceReader(d), RetryPolicy(attempts=1, base_delay_s=0.0,
                                                                  max_delay_s=0.0))
               for url, d in datas.items()}
    monkeypatch.setattr(assimilators.binary, "open_source",
                        lambda url, options=None: sources[url])
    monkeypatch.setattr(buffers, "POOL", buffers.BufferPool())
    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=16, prefetch_mb=16)
    a = engine.register(FaultContext("s3://b/a.bin", "a", format="binary", chunk_size=MiB))
    b = engine.register(FaultContext("s3://b/b.bin", "b", format="binary", chunk_size=MiB))
    store_reads = collections.Counter()
    local = engine.tiers.local
    get, load = local.get, local.load_blocking

    async def counted_get(key, off, size):
        store_reads[key] += 1
        return await get(key, off, size)

    def counted_load(keys):
        store_reads.update(keys)
        return load(keys)

    local.get, local.load_blocking = counted_get, counted_load

    async def read(tag, url, start, end):
        off = start
        while off < end:
            got = await engine.read_view(tag, off, min(256 << 10, end - off))
            assert bytes(got) == datas[url][off:off + len(got)]
            off += len(got)
            await trio.sleep(0.004)

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            with trio.fail_after(120):
                await read(a, "s3://b/a.bin", 0, 32 * MiB)  # one alone: its window landed
                store_reads.clear()
                async with trio.open_nursery() as both:
                    both.start_soon(read, a, "s3://b/a.bin", 32 * MiB, 64 * MiB)
                    both.start_soon(read, b, "s3://b/b.bin", 0, 32 * MiB)
                while engine.busy:  # noqa: ASYNC110 (the engine has no event for it)
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        total = sum(store_reads.values())
        # 11–65 here with the machine's load (the readers' timing decides what lands
        # when), against 195–232 when each window was counted alone
        assert total <= 100, f"{total} store reads for 64 blobs read"
    finally:
        engine.close()


class _Recorder:
    """A nursery that records what the prefetch starts and runs nothing."""

    def __init__(self):
        self.started = []

    def start_soon(self, fn, *args):
        self.started.append(args)


@pytest.mark.parametrize("others", [0, 12])
def test_a_window_opens_within_the_room_other_windows_leave(monkeypatch, tmp_path, others):
    """What one call of the prefetch starts counts against the room (its own runs were not
    counted: a window opened whole with room for 2; a review), and another file's blobs
    kept ahead take at most half of it (a reader that stopped must not hold the next one
    back until its blobs age out)."""
    engine, tag = engine_over(monkeypatch, tmp_path, PieceReader(payload(64 * MiB)),
                              memory_mb=16, prefetch_mb=16)
    try:
        memory, prefetch = engine.tiers.memory, engine.prefetch
        for i in range(others):  # another file's window: landed, not read yet
            memory.keep((999, 100 + i), memoryview(bytearray(MiB)), ahead=True)
        share = prefetch.room_blobs(MiB)
        room = share - min(others, share // 2)
        prefetch.attach(_Recorder())
        prefetch.note_access(tag, 0)
        prefetch.note_access(tag, 1)  # sequential: the window opens
        assert 0 < prefetch.in_flight <= room
    finally:
        engine.close()
