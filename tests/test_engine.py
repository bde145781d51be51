"""The fault engine without a mount: hits, faults, single-flight, store policy, errors, remount.

Sources are in-memory (``MemorySource``) or fail on chosen calls (``FailingSource``): failure
is a fixture, not a mock of the engine.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import time

import pytest
import trio

from faultfs.config import Config
from faultfs.core.context import REGISTRY_TAG, FaultContext
from faultfs.engine import Engine
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.sources import SourceOptions
from faultfs.store.blobfile import FLAG_DIRTY, FLAG_NO_FAULT
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def test_fault_then_hit_with_zero_tail(store):
    data = payload(CS * 2 + 100)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())

    async def main():
        assert await eng.read_blob(tag, 2, 0, CS) == data[2 * CS:] + bytes(CS - 100)
        assert await eng.read_blob(tag, 2, 50, 100) == data[2 * CS + 50:2 * CS + 100] + bytes(50)
        assert await eng.read_view(tag, CS - 10, 30) == data[CS - 10:CS + 20]
        assert await eng.read_view(tag, 0, 10 * CS) == data

    trio.run(main)
    c = eng.stats.counters
    assert src.reads == 3 and c["faults"] == 3 and c["stored"] == 3
    assert c["zero_filled_bytes"] == CS - 100
    assert c["hits"] >= 2


def test_single_flight_shares_one_source_read(store):
    data = payload(CS * 4)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    src.gate = threading.Event()
    results = []

    async def reader(off):
        results.append(bytes(await eng.read_blob(tag, 1, off, 100)))

    async def main():
        async with trio.open_nursery() as nursery:
            for off in range(0, 2000, 100):
                nursery.start_soon(reader, off)
            await trio.sleep(0.2)
            src.gate.set()

    trio.run(main)
    assert src.reads == 1
    assert eng.stats.counters["single_flight_joins"] == 19
    assert sorted(results) == sorted(data[CS + o:CS + o + 100] for o in range(0, 2000, 100))


def test_failed_fault_is_eio_never_zeros_and_is_retried_next_time(store):
    data = payload(CS * 2)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    src.fail_calls = {1}

    async def main():
        with pytest.raises(FaultfsError) as info:
            await eng.read_blob(tag, 0, 0, 10)
        assert info.value.errno == errno.EIO
        assert not eng.is_staged(tag, 0)
        assert await eng.read_blob(tag, 0, 0, 10) == data[:10]

    trio.run(main)
    assert eng.stats.counters["fault_errors"] == 1


def test_a_view_read_over_blobs_held_staged_and_cold_is_exact_and_a_failed_piece_fails_it(store):
    """A view read over four blobs: one memory holds, one only the store, two faulted (one of
    them failing once): the read fails with EIO, no bytes of it served; read again, every
    byte is the source's, in a buffer of the pool that later reads reuse (no fresh mapping
    per read)."""
    from faultfs.buffers import POOL

    cs = 256 << 10  # joins of a megabyte: buffers of the pool, not of the heap
    data = payload(cs * 4)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for(chunk_size=cs))

    async def main():
        assert await eng.read_blob(tag, 2, 0, cs) == data[2 * cs:3 * cs]
        eng.tiers.memory.forget_tag(tag.id)  # blob 2 only in the store now
        assert await eng.read_blob(tag, 1, 0, cs) == data[cs:2 * cs]  # memory and the store
        assert not eng.tiers.is_held((tag.id, 2)) and eng.is_staged(tag, 2)
        assert eng.tiers.is_held((tag.id, 1))
        src.fail_calls = {src.reads + 1}  # the next source read (of blob 0 or 3) fails
        with pytest.raises(FaultfsError) as info:
            await eng.read_view(tag, 10, 4 * cs - 20)
        assert info.value.errno == errno.EIO
        got = await eng.read_view(tag, 10, 4 * cs - 20)
        assert bytes(got) == data[10:4 * cs - 10]
        assert isinstance(memoryview(got).obj, mmap.mmap)  # a buffer of the pool
        del got
        mapped = POOL.mapped
        for _ in range(8):
            assert bytes(await eng.read_view(tag, 10, 4 * cs - 20)) == data[10:4 * cs - 10]
        return mapped

    mapped = trio.run(main)
    assert POOL.mapped - mapped <= 2  # the joins' buffers came back to the pool, taken again


def test_source_shorter_than_registered_fails_the_fault(store):
    data = payload(CS * 2)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    src.data = data[:CS + 10]  # shrank under the mount

    async def main():
        with pytest.raises(FaultfsError):
            await eng.read_blob(tag, 1, 0, 10)

    trio.run(main)


def test_memory_serves_the_rest_of_a_faulted_blob(store):
    src = make_source(payload(CS * 2))
    eng = engine_for(store)
    tag = eng.register(ctx_for())

    async def main():
        for off in range(0, CS, 512):
            assert await eng.read_blob(tag, 0, off, 512) == src.data[off:off + 512]

    trio.run(main)
    assert src.reads == 1
    assert eng.stats.counters["memory_hits"] == CS // 512 - 1


def test_no_store_is_pure_read_through(store):
    src = make_source(payload(CS * 2))
    eng = engine_for(store, store_enabled=False, memory_mb=0)
    tag = eng.register(ctx_for())

    async def main():
        for _ in range(3):
            await eng.read_blob(tag, 0, 0, CS)

    trio.run(main)
    assert src.reads == 3
    assert eng.stats.counters["skipped_no_store"] == 3
    assert store.list_blobs("t") == []


def test_reserve_line_serves_from_source_without_storing(store):
    src = make_source(payload(CS * 2))
    free_mb = store.free_bytes() >> 20
    eng = engine_for(store, reserve_mb=free_mb + 1024)
    tag = eng.register(ctx_for())

    async def main():
        assert await eng.read_blob(tag, 0, 0, CS) == src.data[:CS]

    trio.run(main)
    assert eng.stats.counters["skipped_reserve"] == 1
    assert eng.stats.counters["stored"] == 0


def test_store_full_backoff_counts_exactly(store, monkeypatch):
    src = make_source(payload(CS * 300))
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    from faultfs.store import blobwrite, durable

    real = blobwrite.write_parts  # every blob write's bytes (new names and replacements)
    state = {"calls": 0}

    def write_parts(fd, parts):
        state["calls"] += 1
        if state["calls"] == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, parts)

    monkeypatch.setattr(blobwrite, "write_parts", write_parts)
    monkeypatch.setattr(durable, "write_parts", write_parts)

    async def main():
        for i in range(258):
            assert await eng.read_blob(tag, i, 0, 4) == src.data[i * CS:i * CS + 4]

    trio.run(main)
    c = eng.stats.counters
    assert c["store_failures"] == 1
    assert c["readthrough_backoff"] == 256
    assert c["stored"] == 1  # fault 258 stores again
    assert eng.is_staged(tag, 257) and not eng.is_staged(tag, 0) and not eng.is_staged(tag, 256)
    assert [n for n in os.listdir(store.tag_dir("t")) if n.endswith(".tmp")] == []


def test_cache_cap_evicts_least_recently_used_clean_blobs(store):
    src = make_source(payload(CS * 10))
    eng = engine_for(store, cache_size=3 * (CS + 4096))
    tag = eng.register(ctx_for())

    async def main():
        for i in range(3):
            await eng.read_blob(tag, i, 0, 1)
        await eng.read_blob(tag, 0, 0, 1)  # 0 is now the most recent
        await eng.read_blob(tag, 3, 0, 1)  # evicts 1

    trio.run(main)
    assert [eng.is_staged(tag, i) for i in range(4)] == [True, False, True, True]
    assert sorted(store.list_blobs("t")) == ["chunk_0", "chunk_2", "chunk_3"]
    assert eng.stats.counters["evicted"] == 1
    assert src.reads == 4


def test_a_store_over_its_cap_at_mount_is_trimmed_to_it(store):
    """A store holding more clean blobs than ``--cache-size`` allows when it is opened (the
    cap lowered, a blob stored as its daemon died) is brought under the cap at the mount,
    and every byte still reads right."""
    data = payload(CS * 5)
    make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    assert len(store.list_blobs("t")) == 5
    eng2 = engine_for(store, cache_size=2 * (CS + 4096))
    [tag2] = eng2.recover()
    assert eng2.tiers.local.capacity().used <= 2 * (CS + 4096)
    assert len(store.list_blobs("t")) == 2 == eng2.staged_count(tag2)
    assert eng2.stats.counters["evicted"] == 3
    assert bytes(trio.run(eng2.read_view, tag2, 0, len(data))) == data
    eng2.close()


def test_remount_recovers_tags_and_hits_with_zero_source_reads(store):
    data = payload(CS * 3 + 5)
    make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for(src_token="SECRET-TOKEN"))

    async def read_all(e, t):
        return await e.read_view(t, 0, len(data))

    assert trio.run(read_all, eng, tag) == data
    eng.close()
    src2 = make_source(data)  # same URL, fresh read counter
    eng2 = engine_for(store)
    [tag2] = eng2.recover()
    assert tag2.name == "t" and eng2.staged_count(tag2) == 4
    assert trio.run(read_all, eng2, tag2) == data
    assert src2.reads == 0
    for name in store.list_blobs(REGISTRY_TAG):
        assert b"SECRET-TOKEN" not in store.read(REGISTRY_TAG, name)
        mode = os.stat(store.blob_path(REGISTRY_TAG, name)).st_mode & 0o777
        assert mode == 0o600


def test_changed_source_makes_staged_blobs_stale_on_remount(store):
    data = payload(CS * 2)
    make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))
    new = bytes(reversed(data))
    src2 = make_source(new)
    src2.token = "v2"
    eng2 = engine_for(store)
    [tag2] = eng2.recover()
    assert eng2.staged_count(tag2) == 0 and tag2.stale_dropped == 2 and tag2.source_changed
    assert trio.run(eng2.snapshot)["tags"]["t"]["source_changed_at_mount"] is True
    assert trio.run(eng2.read_view, tag2, 0, len(new)) == new
    assert src2.reads == 2


def test_corrupt_staged_blob_is_refaulted_not_served(store):
    data = payload(CS * 2)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))
    path = store.blob_path("t", "chunk_1")
    with open(path, "r+b") as f:
        f.seek(4096 + 10)
        f.write(b"\xff\xfe")
    eng2 = engine_for(store)
    [tag2] = eng2.recover()
    assert trio.run(eng2.read_blob, tag2, 1, 0, CS) == data[CS:]
    assert src.reads == 3
    assert eng2.stats.counters["corrupt_blobs_dropped"] == 1


def test_assimilator_that_cannot_ingest_per_blob_fails_with_minus_20(store):
    make_source(b"abc", "mem://nb")
    eng = engine_for(store)
    with pytest.raises(FaultfsError) as info:
        eng.register(FaultContext(src="mem://nb", dst="nb", format="noblob"))
    assert info.value.code == -20
    assert "-20" in str(info.value)
    assert store.list_blobs(REGISTRY_TAG) == []


@pytest.mark.parametrize(("kw", "match"), [
    ({"range_off": CS * 3}, "past the end"),
    ({"range_off": 10, "range_size": CS * 2}, "past the end"),
])
def test_bad_ranges_change_nothing(store, kw, match):
    make_source(payload(CS * 2))
    eng = engine_for(store)
    with pytest.raises(InvalidInput, match=match):
        eng.register(ctx_for(**kw))
    assert store.list_tags() == []


def test_range_and_blob_prefix(store):
    data = payload(CS * 4)
    make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for(range_off=100, range_size=CS + 50, blob_prefix=""))
    assert tag.layout.num_blobs == 2 and tag.layout.blob_name(1) == "1"
    assert trio.run(eng.read_view, tag, 0, 10 * CS) == data[100:100 + CS + 50]
    assert trio.run(eng.read_blob, tag, 1, 0, CS) == data[100 + CS:100 + CS + 50] + bytes(CS - 50)


def test_re_registration_with_a_new_context_replaces_the_old_one(store):
    make_source(payload(CS * 4))
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_blob, tag, 0, 0, 1)
    old_key = tag.key
    eng.close()
    eng2 = engine_for(store)
    tag2 = eng2.register(ctx_for(chunk_size=2 * CS))
    assert tag2.key != old_key
    assert store.list_blobs(REGISTRY_TAG) == [tag2.key]
    assert store.list_blobs("t") == []


async def settle(eng):
    """Wait until background prefetches and store writes (on threads) are done."""
    with trio.fail_after(10):
        while eng.busy:  # noqa: ASYNC110 - test polls
            await trio.sleep(0.005)


def test_attached_engine_prefetches_for_sequential_readers_only(store):
    data = payload(CS * 64)
    src = make_source(data)
    eng = engine_for(store, memory_mb=1, prefetch_mb=1)  # budget: 512 KiB = 128 blobs
    tag = eng.register(ctx_for())

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            for i in range(8):  # sequential
                assert await eng.read_blob(tag, i, 0, CS) == data[i * CS:(i + 1) * CS]
            await settle(eng)
            assert eng.stats.counters["prefetches"] > 0
            assert eng.is_staged(tag, 9), "blobs ahead of a sequential reader are faulted and stored"
            before = eng.stats.counters["prefetches"]
            for i in (40, 20, 60, 30):  # random: no prefetch
                assert await eng.read_blob(tag, i, 0, 10) == data[i * CS:i * CS + 10]
            await settle(eng)
            assert eng.stats.counters["prefetches"] == before
            nursery.cancel_scope.cancel()

    trio.run(main)
    c = eng.stats.counters
    assert c["source_bytes"] == c["faults"] * CS, "every blob read from the source once"
    assert src.reads == c["source_reads"] < c["faults"], "adjacent blobs ahead share one read"


def test_background_store_keeps_bytes_servable_until_on_disk(store):
    data = payload(CS * 4)
    src = make_source(data)
    eng = engine_for(store, memory_mb=0, prefetch_mb=0)
    tag = eng.register(ctx_for())

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            assert await eng.read_blob(tag, 1, 0, CS) == data[CS:2 * CS]
            # the store write may still be pending: the bytes are held, not re-faulted
            assert await eng.read_blob(tag, 1, 100, 10) == data[CS + 100:CS + 110]
            await settle(eng)
            assert eng.is_staged(tag, 1) and not eng.pending_stores
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads == 1
    assert store.read("t", "chunk_1", source_version=tag.version_text) == data[CS:2 * CS]


def test_sequential_reader_of_staged_blobs_is_served_from_a_read_ahead(store):
    data = payload(CS * 32)
    make_source(data)
    eng = engine_for(store, memory_mb=1, prefetch_mb=1)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))  # stage everything (no nursery: inline)
    eng.close()
    src = make_source(data)
    eng2 = engine_for(store, memory_mb=1, prefetch_mb=1)
    [tag2] = eng2.recover()

    async def main():
        async with trio.open_nursery() as nursery:
            eng2.attach(nursery)
            for i in range(32):
                assert await eng2.read_blob(tag2, i, 0, CS) == data[i * CS:(i + 1) * CS]
            await settle(eng2)
            nursery.cancel_scope.cancel()

    trio.run(main)
    c = eng2.stats.counters
    assert src.reads == 0 and c["faults"] == 0
    assert c["store_readahead"] > 0 and c["memory_hits"] > 0


def test_registration_persists_no_credentials_from_a_url(store):
    from faultfs.sources import persistable_src

    url = "mem://b/k?X-Amz-Signature=deadbeefcafe&X-Amz-Credential=AKIA123"
    make_source(payload(CS), url=url)
    eng = engine_for(store)
    tag = eng.register(ctx_for(url))
    assert tag.ctx.src == persistable_src(url) != url
    for name in store.list_blobs(REGISTRY_TAG):
        text = store.read(REGISTRY_TAG, name)
        assert b"deadbeefcafe" not in text and b"AKIA123" not in text
    assert trio.run(eng.read_blob, tag, 0, 0, 10) == payload(CS)[:10], "the open source serves"


@pytest.mark.parametrize("inline_kb", [64, 0])
def test_small_staged_reads_inline_or_on_the_pool_serve_the_same_verified_bytes(store, inline_kb):
    """--inline-read-kb: small reads of staged blobs run on the serving thread (no pool trip)
    unless it is 0; either way they are verified, and a damaged block is re-faulted."""
    BIG = 256 << 10  # several 16 KiB checksum blocks per blob
    data = payload(BIG * 3)
    src = make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for(chunk_size=BIG))
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    faulted = src.reads
    with open(store.blob_path("t", "chunk_2"), "r+b") as f:
        f.seek(4096 + 5)
        f.write(b"\xff\xfe\xfd")
    eng2 = engine_for(store, inline_read_kb=inline_kb)
    [tag2] = eng2.recover()
    trips = []
    real_run_io = eng2.pool.run

    async def counting_run_io(fn, *args):
        trips.append(getattr(fn, "__name__", repr(fn)))
        return await real_run_io(fn, *args)

    eng2.pool.run = counting_run_io

    async def reads():
        got = []
        for index in (0, 1, 0, 1):
            for off in (0, 4096, BIG - 4096):
                got.append(bytes(await eng2.read_blob(tag2, index, off, 4096)))
        return got

    expected = [data[i * BIG + off:i * BIG + off + 4096]
                for i in (0, 1, 0, 1) for off in (0, 4096, BIG - 4096)]
    assert trio.run(reads) == expected
    assert src.reads == faulted  # all hits
    if inline_kb:
        assert trips == []
    else:
        assert "_open_and_read" in trips
    assert bytes(trio.run(eng2.read_blob, tag2, 2, 0, 4096)) == data[2 * BIG:2 * BIG + 4096]
    assert eng2.stats.counters["corrupt_blobs_dropped"] == 1 and src.reads == faulted + 1


def test_remount_of_an_unchanged_source_reads_no_blob_headers(store, monkeypatch):
    """The tag state names the source version the blobs were staged from: when it is still
    the current one, the mount lists and stats the blobs and opens none."""
    data = payload(CS * 5 + 7)
    make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    opened = []
    real = BlobStore.read_header

    def counting(self, path):
        opened.append(path)
        return real(self, path)

    monkeypatch.setattr(BlobStore, "read_header", counting)
    src = make_source(data)
    eng2 = engine_for(store)
    tag2 = eng2.register(ctx_for())
    assert opened == [] and eng2.staged_count(tag2) == 6 and eng2.tiers.local.policy.lru_bytes > 0
    eng3 = engine_for(store)
    [tag3] = eng3.recover()
    assert opened == [] and eng3.staged_count(tag3) == 6
    assert trio.run(eng2.read_view, tag2, 0, len(data)) == data and src.reads == 0


def test_a_blob_staged_from_another_version_is_refaulted_even_when_the_scan_trusted_it(store):
    """A clean blob whose header names another source version is never served: the read
    checks the header and re-faults it."""
    data = payload(CS * 2)
    make_source(data)
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    store.put("t", "chunk_1", bytes(reversed(data[CS:])), flags=FLAG_NO_FAULT,
              source_version="99 elsewhere")
    src = make_source(data)
    eng2 = engine_for(store)
    tag2 = eng2.register(ctx_for())
    assert eng2.staged_count(tag2) == 2
    assert trio.run(eng2.read_view, tag2, 0, len(data)) == data and src.reads == 1


def test_memory_drops_the_blobs_of_a_run_together():
    """Blobs of one source run share a buffer: holding one must not keep the others' bytes,
    so dropping one drops its siblings and what is held stays within the bound."""
    from faultfs.tiers.memory import MemoryTier

    run = memoryview(bytearray(4 * 100))
    memory = MemoryTier(capacity=500)
    for i in range(4):
        memory.keep((1, i), run[i * 100:(i + 1) * 100])
    memory.keep((2, 0), memoryview(bytearray(100)))
    assert memory.size == 500
    memory.held((1, 3))  # one blob of the run stays hot
    memory.keep((2, 1), memoryview(bytearray(100)))  # evicts (1, 0), and with it the run
    assert [k for k in [(1, i) for i in range(4)] if k in memory] == []
    assert (2, 0) in memory and (2, 1) in memory and memory.size == 200
    memory.keep((3, 0), b"x" * 50)  # plain bytes: no run
    memory.discard((3, 0))
    assert memory.size == 200


def test_remote_settings_kept_for_remounts_never_hold_credentials():
    from faultfs.engine import recovery_options, remote_settings

    opts = SourceOptions(s3_endpoint_url="http://127.0.0.1:9000", anon=True)
    assert remote_settings("s3://b/k", opts) == {"s3_endpoint_url": "http://127.0.0.1:9000",
                                                 "anon": True}
    assert remote_settings("/local/file", opts) == {}
    for secret in ("http://user:pw@host:9000", "https://host/?X-Amz-Signature=abc"):
        assert remote_settings("s3://b/k", SourceOptions(s3_endpoint_url=secret)) == {}
    recorded = {"s3_endpoint_url": "http://recorded:1", "anon": True}
    assert recovery_options(SourceOptions(), recorded).s3_endpoint_url == "http://recorded:1"
    assert recovery_options(SourceOptions(), recorded).anon is True
    flag = recovery_options(SourceOptions(s3_endpoint_url="http://flag:2"), recorded)
    assert flag.s3_endpoint_url == "http://flag:2", "the mount's flag wins"


@pytest.mark.parametrize("trusted_scan", [True, False])
def test_a_dirty_blob_is_never_evicted_or_replaced_by_a_fault(store, trusted_scan):
    """A dirty blob (user data) under a chunk name, found at mount with (trusted scan) or
    without its header read, survives the --cache-size eviction and stays what is served."""
    data = payload(CS * 4)
    make_source(data, "mem://a")
    eng = engine_for(store)
    tag = eng.register(ctx_for("mem://a", "a"))
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    user = b"U" * CS
    store.put("a", "chunk_0", user, flags=FLAG_DIRTY)
    if not trusted_scan:  # another recorded version: every header is read at mount
        state = store.read_tag_state("a")
        state["source_version"] = "0 elsewhere"
        store.write_tag_state("a", state)
    make_source(data, "mem://a")
    make_source(payload(CS * 8)[::-1], "mem://b")
    eng2 = engine_for(store, cache_size=4 * (CS + 4096) + 1)
    tag_a = eng2.register(ctx_for("mem://a", "a"))
    tag_b = eng2.register(ctx_for("mem://b", "b"))

    async def main():
        for i in range(8):  # each stored blob of b evicts least recently used blobs of a
            await eng2.read_blob(tag_b, i, 0, CS)
        return bytes(await eng2.read_blob(tag_a, 0, 0, CS))

    assert trio.run(main) == user
    assert store.read("a", "chunk_0") == user


def test_remote_settings_are_recorded_at_registration_and_kept_by_remounts(store):
    data = payload(CS * 2)
    make_source(data)
    Engine(store, Config(store_dir=store.root, reserve_mb=0),
           SourceOptions(anon=True)).register(ctx_for())
    assert store.read_tag_state("t")["remote"] == {"anon": True}
    [tag] = engine_for(store).recover()  # a remount without --anon: still anonymous
    assert tag.remote == {"anon": True} and store.read_tag_state("t")["remote"] == {"anon": True}
    engine_for(store).register(ctx_for())  # registering the source again records anew
    assert "remote" not in store.read_tag_state("t")


def test_a_local_source_rewritten_in_place_with_its_mtime_restored_is_a_new_version(tmp_path):
    """cp -p, rsync -t, tar x and os.utime put the old mtime back; the change time and the
    inode still tell: the fault of the rest fails (never old MiBs next to new ones), a remount
    re-faults everything from the new bytes."""
    path = tmp_path / "field.bin"
    old = payload(3 * CS)
    path.write_bytes(old)
    store = BlobStore(str(tmp_path / "store"))
    eng = engine_for(store)
    tag = eng.register(FaultContext(src=str(path), dst="t", chunk_size=CS))
    assert bytes(trio.run(eng.read_blob, tag, 0, 0, CS)) == old[:CS]
    st = os.stat(path)
    new = bytes(b ^ 0xFF for b in old)
    with open(path, "r+b") as f:  # same size, in place
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size
    with pytest.raises(FaultfsError) as info:
        trio.run(eng.read_blob, tag, 1, 0, CS)
    assert info.value.errno == errno.EIO and "changed under the mount" in info.value.message
    assert tag.changed_under_mount
    snap = trio.run(eng.snapshot)
    assert "changed under the mount" in snap["tags"]["t"]["source_changed_under_mount"]
    eng.close()
    eng2 = engine_for(store)
    [tag2] = eng2.recover()
    assert tag2.source_changed and tag2.stale_dropped == 1
    assert bytes(trio.run(eng2.read_view, tag2, 0, 3 * CS)) == new


def test_a_local_source_replaced_under_its_name_is_a_new_version(tmp_path):
    path = tmp_path / "field.bin"
    path.write_bytes(payload(2 * CS))
    store = BlobStore(str(tmp_path / "store"))
    eng = engine_for(store)
    tag = eng.register(FaultContext(src=str(path), dst="t", chunk_size=CS))
    trio.run(eng.read_view, tag, 0, 2 * CS)
    st = os.stat(path)
    other = tmp_path / "other.bin"
    other.write_bytes(payload(2 * CS)[::-1])
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, path)
    eng.close()
    eng2 = engine_for(store)
    [tag2] = eng2.recover()
    assert tag2.source_changed and tag2.stale_dropped == 2
    assert bytes(trio.run(eng2.read_view, tag2, 0, 2 * CS)) == payload(2 * CS)[::-1]


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_source_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    import socket

    path = tmp_path / "src"
    with contextlib.ExitStack() as stack:
        if kind == "fifo":
            os.mkfifo(path)
        else:
            sock = stack.enter_context(socket.socket(socket.AF_UNIX))
            sock.bind(str(path))
        store = BlobStore(str(tmp_path / "store"))
        eng = engine_for(store)
        started = time.monotonic()
        with pytest.raises(InvalidInput, match="is not a regular file"):
            eng.register(FaultContext(src=str(path), dst="t"))
        assert time.monotonic() - started < 5
        assert store.list_blobs(REGISTRY_TAG) == []


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "symlinked tag directory"])
def test_a_foreign_entry_where_a_blob_should_be_is_absent_never_a_hang(tmp_path, kind):
    """A FIFO there froze the serving thread (and every request of the mount); a link was
    followed out of the store. Each is now absent: re-faulted, served, stored."""

    data = payload(3 * CS)
    make_source(data)
    store = BlobStore(str(tmp_path / "store"))
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))  # everything staged
    eng.close()
    outside = tmp_path / "outside"
    outside.write_bytes(b"not yours")
    path = store.blob_path("t", "chunk_1")
    if kind == "symlinked tag directory":
        elsewhere = tmp_path / "elsewhere"
        os.rename(store.tag_dir("t"), elsewhere)
        os.symlink(elsewhere, store.tag_dir("t"))
    else:
        os.unlink(path)
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink":
            os.symlink(outside, path)
        else:
            os.mkdir(path)
    eng2 = engine_for(store)
    started = time.monotonic()
    [tag2] = eng2.recover()
    assert trio.run(eng2.read_view, tag2, 0, len(data)) == data
    assert time.monotonic() - started < 10
    assert outside.read_bytes() == b"not yours"
    assert os.path.isfile(path) and not os.path.islink(path), "the blob was stored again"
    assert not os.path.islink(store.tag_dir("t"))


def test_a_foreign_tag_state_is_ignored_not_fatal(tmp_path):
    data = payload(2 * CS)
    make_source(data)
    store = BlobStore(str(tmp_path / "store"))
    eng = engine_for(store)
    tag = eng.register(ctx_for())
    trio.run(eng.read_view, tag, 0, len(data))
    eng.close()
    state = os.path.join(store.tag_dir("t"), "tag.json")
    os.unlink(state)
    os.mkfifo(state)
    eng2 = engine_for(store)
    [tag2] = eng2.recover()
    assert trio.run(eng2.read_view, tag2, 0, len(data)) == data


def _staged_engine(store, blobs: int, cs: int = 64 << 10, staged=None):
    """An engine (``--memory-mb 1``) over a source of ``blobs`` blobs of ``cs``, the blobs
    ``staged`` (all by default) in the store and none in memory."""
    make_source(payload(cs * blobs))
    eng = engine_for(store, memory_mb=1)
    tag = eng.register(ctx_for(chunk_size=cs))

    async def stage():
        for i in (range(blobs) if staged is None else staged):
            await eng.read_blob(tag, i, 0, 1)

    trio.run(stage)
    eng.tiers.memory.forget_tag(tag.id)
    return eng, tag


def _started(eng, tag, indices, urgent=False) -> dict:
    """``start_blobs`` on a running engine, its loads held until counted; what it started."""
    gate = threading.Event()
    real = eng.tiers.read_ahead_blocking
    eng.tiers.read_ahead_blocking = lambda keys: gate.wait(5) and real(keys)
    got = {}

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            got["started"] = eng.prefetch.start_blobs(tag, indices, urgent)
            got["held"] = eng.tiers.budget.in_flight
            got["cold"] = [i for i in indices if (tag.id, i) in eng.flights
                           and not eng.tiers.contains((tag.id, i))]
            gate.set()
            while eng.prefetch.in_flight:  # noqa: ASYNC110 - the loads run on the pool
                await trio.sleep(0.01)
            got["after"] = eng.tiers.budget.in_flight
            nursery.cancel_scope.cancel()

    trio.run(main)
    return got


def test_staged_blobs_read_ahead_hold_their_bytes_within_the_budget_and_the_share(store):
    """Staged blobs the HDF5 lookahead asks for are read from the store into memory: their
    bytes are held against ``--memory-mb`` while under way (an urgent start, which passes
    the prefetch's reach, still stops at the budget), a plain start reads only as far as
    the prefetch's share, and the budget is given back once they are in memory."""
    cs = 64 << 10
    eng, tag = _staged_engine(store, 64, cs)
    limit, share = eng.tiers.budget.limit, eng.prefetch.budget
    got = _started(eng, tag, list(range(0, 64, 2)), urgent=True)
    assert 0 < got["started"] * cs <= limit and got["held"] <= limit, got
    assert got["after"] == 0, got
    eng.tiers.memory.forget_tag(tag.id)
    got = _started(eng, tag, list(range(1, 64, 2)))
    assert 0 < got["started"] * cs <= share, (share, got)


def test_far_staged_blobs_do_not_take_the_reach_from_the_nearest_cold_ones(store):
    """The lookahead names blobs nearest first: the cold ones the reader reads next start
    even when staged ones further on would fill the prefetch's reach."""
    eng, tag = _staged_engine(store, 64, staged=range(20, 64))
    got = _started(eng, tag, [0, 1, *range(20, 50, 2)])
    assert got["cold"] == [0, 1], got


def test_a_staged_run_longer_than_the_share_starts_its_nearest_blobs(store):
    """A plain start over more adjacent staged blobs than the prefetch's share reads the
    nearest of them (the share's worth), not nothing."""
    cs = 64 << 10
    eng, tag = _staged_engine(store, 32, cs, staged=range(0, 16))  # 1 MiB: a share of 8
    got = _started(eng, tag, list(range(0, 18)))  # 16 staged, then 2 cold
    assert got["started"] == eng.prefetch.budget // cs, got


def test_two_warm_sequential_readers_read_each_blob_from_the_store_about_once(tmp_path):
    """Two warm sequential readers of files larger than ``--memory-mb``: the blobs read
    ahead from the store for one are not dropped before their reader gets there (by the
    other's loads making room, or by a load's bytes counted twice while they fill memory)
    and read again."""
    cs, step, blobs, mem = 1 << 20, 128 << 10, 64, 8
    store = BlobStore(str(tmp_path / "store"))
    datas = [payload(cs * blobs + k)[k:] for k in range(2)]
    eng = engine_for(store, memory_mb=mem)
    for k in range(2):
        make_source(datas[k], f"mem://f{k}")
        tag = eng.register(ctx_for(url=f"mem://f{k}", tag=f"t{k}", chunk_size=cs))
        trio.run(eng.read_view, tag, 0, len(datas[k]))
    eng.close()
    eng = engine_for(store, memory_mb=mem)
    tags = sorted(eng.recover(), key=lambda t: t.name)
    trips = []  # to the store: each blob read ahead, each read a reader made there
    load, get = eng.tiers.local.load_blocking, eng.tiers.local.get
    eng.tiers.local.load_blocking = lambda keys: (trips.extend(keys), load(keys))[1]

    async def counted_get(key, off, size):
        trips.append(key)
        return await get(key, off, size)

    eng.tiers.local.get = counted_get

    async def reader(k):
        for off in range(0, len(datas[k]), step):
            assert bytes(await eng.read_view(tags[k], off, step)) == datas[k][off:off + step]
            await trio.sleep(0.002)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            async with trio.open_nursery() as readers:
                for k in range(2):
                    readers.start_soon(reader, k)
            while eng.busy:  # noqa: ASYNC110 - its store reads run on the pool
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert eng.tiers.budget.in_flight == 0
    assert len(trips) <= 1.25 * 2 * blobs + 48, (len(trips), 2 * blobs)
