"""The fault engine without a mount: hits, faults, single-flight, store policy, errors, remount.

Sources are in-memory (``MemorySource``) or fail on chosen calls (``FailingSource``): failure
is a fixture, not a mock of the engine.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

import pytest
import trio

from faultfs.config import Config
from faultfs.core.context import REGISTRY_TAG, FaultContext
from faultfs.engine import Engine
from faultfs.engine.writes import Base
from faultfs.errors import FaultfsError, InvalidInput, StoreFull
from faultfs.sources import SourceOptions
from faultfs.store.blobfile import FLAG_DIRTY, FLAG_NO_FAULT
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload
from faultfs.tiers.base import StoreOutcome


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
    import time

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
    import time

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


def _put_through(eng, before):
    """Replace the local tier's ``put`` with ``before(key)`` (async, may return an outcome to
    skip the real store write) followed by the real one."""
    real = eng.tiers.local.put

    async def put(key, data):
        outcome = await before(key)
        return outcome if outcome is not None else await real(key, data)

    eng.tiers.local.put = put


def _writing_engine(store, chunks, *, gated=False):
    """A source of ``chunks`` chunks and an engine over it for the write tests (``gated``:
    every source read waits for ``src.gate``)."""
    data = payload(CS * chunks)
    src = make_source(data)
    if gated:
        src.gate = threading.Event()
    eng = engine_for(store, memory_mb=1, prefetch_mb=0)
    return data, src, eng, eng.register(ctx_for())


def test_a_partial_write_of_an_unstaged_chunk_is_answered_before_its_fault(store):
    """The size-0 request is issued behind the write: the write is journaled and answered
    while the source read is held at a gate; a read meanwhile joins that fault (one source
    read); the base ends up staged and pinned, beneath the written bytes."""
    data, src, eng, tag = _writing_engine(store, 4, gated=True)
    want = bytearray(data[CS:2 * CS])
    want[100:110] = b"x" * 10
    got = []

    async def reader():
        got.append(bytes(await eng.read_blob(tag, 1, 0, CS)))

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.writes.write_chunk(tag, 1, 100, b"x" * 10)
                assert eng.writes.base_faults == 1 and eng.busy
                nursery.start_soon(reader)
                await trio.sleep(0.05)
                assert not got, "the read waits for the base, at the gate"
            src.gate.set()
            await settle(eng)
            assert got == [want]
            assert eng.is_staged(tag, 1) and (tag.id, 1) in eng.tiers.local._pinned
            assert await eng.read_blob(tag, 1, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads == 1 and eng.stats.counters["faults"] == 1


def test_size_0_requests_behind_writes_are_bounded_past_that_the_write_waits(store):
    """At most BASE_FAULTS base faults run behind writes; the next partial write of another
    unstaged chunk faults its base itself before it is answered."""
    from faultfs.engine.writes import BASE_FAULTS

    n = BASE_FAULTS + 1
    data, src, eng, tag = _writing_engine(store, n + 1, gated=True)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                for i in range(BASE_FAULTS):
                    await eng.writes.write_chunk(tag, i, 7, b"w")
                assert eng.writes.base_faults == BASE_FAULTS
            done = trio.Event()

            async def last():
                await eng.writes.write_chunk(tag, BASE_FAULTS, 7, b"w")
                done.set()

            nursery.start_soon(last)
            await trio.sleep(0.1)
            assert not done.is_set(), "past the bound the write waits for its own fault"
            src.gate.set()
            with trio.fail_after(5):
                await done.wait()
            await settle(eng)
            assert eng.writes.base_faults == 0
            for i in range(n):
                want = bytearray(data[i * CS:(i + 1) * CS])
                want[7:8] = b"w"
                assert await eng.read_blob(tag, i, 0, CS) == want
                assert (tag.id, i) in eng.tiers.local._pinned
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads == n


@pytest.mark.parametrize("then", ["reset", "whole", "fold"])
def test_a_blob_reset_rewritten_or_folded_while_its_base_faults_leaves_no_pin(store, then):
    """The base fault behind a write lands after the blob was reset, written whole or
    folded: the staged copy it pinned is let go (evictable again), the bytes are right."""
    data, src, eng, tag = _writing_engine(store, 2, gated=True)
    want = bytearray(data[:CS])

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.writes.write_chunk(tag, 0, 5, b"abc")
                if then == "reset":
                    assert await eng.writes.reset(tag) == 1
                elif then == "whole":
                    want[:] = b"z" * CS
                    await eng.writes.write_chunk(tag, 0, 0, b"z" * CS)
                else:
                    want[5:8] = b"abc"
                    nursery.start_soon(eng.writes.checkpoint)  # its fold joins the fault
                    await trio.sleep(0.05)
            src.gate.set()
            await settle(eng)
            with trio.fail_after(5):
                await eng.writes.checkpoint()
            assert eng.writes.base_faults == 0
            assert (tag.id, 0) not in eng.tiers.local._pinned
            assert await eng.read_blob(tag, 0, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads <= 2


@pytest.mark.parametrize("name", ["view", "user"])
def test_a_write_refused_for_room_partway_returns_the_bytes_that_landed(store, name):
    """A write across chunks (or user blob parts) whose second piece the store has no room
    for (ENOSPC) returns a short count, as a full disk's write does: the first piece is
    written and the file's size is what landed, never ENOSPC over bytes that did land; a
    write refused at its first piece is refused whole."""
    _, _, eng, tag = _writing_engine(store, 4)
    room = _NoRoom(eng)
    eng.writes.user_part = CS

    async def write(off, payload):
        if name == "view":
            return await eng.writes.write_view(tag, off, payload)
        return await eng.writes.write_user(tag, "notes", off, payload)

    async def size():
        if name == "view":
            return eng.writes.view_size(tag)
        return eng.writes.user_size(tag, "notes")

    async def read(off, n):
        if name == "view":
            return bytes(await eng.read_view(tag, off, n))
        return bytes(await eng.writes.read_user(tag, "notes", off, n))

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                if name == "user":
                    await eng.writes.create_user(tag, "notes")
                start = 4 * CS - 100 if name == "view" else CS - 100
                room.left = 1  # the first piece's record, then no room
                assert await write(start, b"y" * 300) == 100
                room.left = None
                assert await size() == start + 100
                assert await read(start, 100) == b"y" * 100
                room.left = 0
                with pytest.raises(FaultfsError) as err:
                    await write(start + 100, b"z" * 50)
                assert err.value.errno == errno.ENOSPC
                room.left = None
                assert await size() == start + 100
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()


def _slow_journal_syncs(eng):
    """Make the journal's syncs slow (so fsyncs queue behind one) and note, for each, the
    journal's next seq when it began."""
    began = []
    sync = eng.writes.journal.sync

    def slow():
        began.append(eng.writes.journal.next_seq)
        time.sleep(0.05)
        sync()

    eng.writes.journal.sync = slow
    return began


def test_fsyncs_queued_behind_a_sync_are_answered_by_it(store):
    """Group commit: eight writers fsyncing at once after their writes cost one journal sync
    (it began after every write), and the other seven are answered by it."""
    _, _, eng, tag = _writing_engine(store, 8)
    began = _slow_journal_syncs(eng)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            for i in range(8):
                await eng.writes.write_chunk(tag, i, 0, b"w" * CS)  # whole: no base fault
                await eng.writes.write_chunk(tag, i, 7, b"x")
            last = eng.writes.journal.next_seq
            with trio.fail_after(5):
                async with trio.open_nursery() as writers:
                    for _ in range(8):
                        writers.start_soon(eng.writes.fsync)
            assert began == [last]
            nursery.cancel_scope.cancel()

    trio.run(main)
    c = eng.stats.counters
    assert c["fsyncs"] == 8 and c["fsyncs_joined"] == 7
    eng.close()


def test_an_fsync_after_a_write_made_during_a_sync_syncs_again(store):
    """A sync under way began before this write: an fsync after the write waits for it and
    then syncs again, never answered by the older sync."""
    _, _, eng, tag = _writing_engine(store, 2)
    began = _slow_journal_syncs(eng)
    order = []

    async def first():
        await eng.writes.fsync()
        order.append("first")

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.writes.write_chunk(tag, 0, 0, b"a" * CS)
            with trio.fail_after(5):
                async with trio.open_nursery() as writers:
                    writers.start_soon(first)
                    while not began:  # noqa: ASYNC110 - filled on a worker thread (50 ms sync)
                        await trio.sleep(0.001)
                    assert not order
                    await eng.writes.write_chunk(tag, 1, 0, b"b" * CS)
                    written = eng.writes.journal.next_seq
                    await eng.writes.fsync()
                    order.append("second")
            assert len(began) == 2 and began[1] >= written
            assert order == ["first", "second"]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert eng.stats.counters["fsyncs_joined"] == 0
    eng.close()


def _recovered_over_a_new_version(store, data):
    """The source changed (its bytes reversed, a new version token) and the store remounted
    over it: (the engine, its recovered tag, the new bytes)."""
    new = bytes(reversed(data))
    src = make_source(new)
    src.token = "v2"
    eng = engine_for(store, memory_mb=1, prefetch_mb=0)
    [tag] = eng.recover()
    return eng, tag, new


class _NoRoom:
    """The engine's journal as a full store sees it: appends fail with StoreFull (ENOSPC)
    while ``full``, or, with ``left`` a count, once that many more went through."""

    def __init__(self, eng, *, full=False):
        self.full = full
        self.left = None
        self._append = eng.writes.journal.append
        eng.writes.journal.append = self.append

    def append(self, *args, **kwargs):
        if self.left is not None:
            if self.left <= 0:
                raise StoreFull("no room")
            self.left -= 1
        elif self.full:
            raise StoreFull("no room")
        return self._append(*args, **kwargs)


@pytest.mark.parametrize("staged", [True, False])
def test_a_refused_write_leaves_its_chunk_unpinned_and_the_source_bytes_in_place(store,
                                                                                  staged):
    """A partial write the store has no room for (ENOSPC from the journal): the pin its
    size-0 request took of the staged chunk (or the one its base fault takes when it lands)
    is let go, so the chunk stays evictable; it reads the source's bytes; the next write
    pins it again."""
    data, src, eng, tag = _writing_engine(store, 2, gated=not staged)
    room = _NoRoom(eng, full=True)
    key = (tag.id, 0)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                if staged:
                    assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                    await settle(eng)
                    assert eng.is_staged(tag, 0)
                with pytest.raises(FaultfsError) as err:
                    await eng.writes.write_chunk(tag, 0, 5, b"abc")
                assert err.value.errno == errno.ENOSPC
                if not staged:
                    assert eng.writes.base_faults == 1
                    src.gate.set()
                await settle(eng)
                assert key not in eng.tiers.local._pinned
                assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                room.full = False
                await eng.writes.write_chunk(tag, 0, 5, b"abc")
                await settle(eng)
                assert key in eng.tiers.local._pinned
                want = bytearray(data[:CS])
                want[5:8] = b"abc"
                assert await eng.read_blob(tag, 0, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("size", ["partial", "whole"])
def test_a_refused_write_leaves_no_dirty_blob_behind(store, size):
    """A write the store has no room for (ENOSPC) changed nothing: the chunk is not dirty,
    a read does not pin it again, a checkpoint writes no dirty copy of the source's bytes,
    and after a remount over a new version of the source the chunk reads the new version
    (not the old one frozen in a dirty file); nor does the tag count as written."""
    data, _, eng, tag = _writing_engine(store, 2)
    room = _NoRoom(eng)
    key = (tag.id, 0)
    written = b"x" * 10 if size == "partial" else b"x" * CS

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                await settle(eng)
                await eng.writes.write_chunk(tag, 1, 0, b"w" * 10)  # the journal is not empty
                room.full = True
                with pytest.raises(FaultfsError) as err:
                    await eng.writes.write_chunk(tag, 0, 0, written)
                assert err.value.errno == errno.ENOSPC
                room.full = False
                await settle(eng)
                assert not eng.writes.is_dirty(tag, 0)
                assert eng.writes.dirty_summary(tag)[0] == 1, "chunk_1 only"
                assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                await settle(eng)
                assert key not in eng.tiers.local._pinned, "a read pins no chunk nobody wrote"
                await eng.writes.checkpoint()
                assert "chunk_0" not in eng.writes.files.names(tag.name)
                await eng.close_writes()
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()
    eng2, tag2, new = _recovered_over_a_new_version(store, data)
    assert trio.run(eng2.read_blob, tag2, 0, 0, CS) == new[:CS], "never the old version"
    eng2.close()

@pytest.mark.parametrize("name", ["view", "user"])
def test_a_write_across_the_growth_limit_writes_what_fits(store, name):
    """Like a file size limit: a write that starts below 16 TiB and ends past it writes the
    bytes up to the limit and returns that short count (one FUSE request can carry a whole
    `dd bs=1M` block, not only the page the kernel splits off); a write at the limit is
    EFBIG and changes nothing."""
    from faultfs.engine.writes import MAX_GROWN

    _, _, eng, tag = _writing_engine(store, 2)
    w = eng.writes

    async def main():
        if name == "view":
            write, size = w.write_view, w.view_size

            async def read(off, n):
                return await eng.read_view(tag, off, n)
        else:
            await w.create_user(tag, "notes.bin")

            async def write(tag, off, data):
                return await w.write_user(tag, "notes.bin", off, data)

            def size(tag):
                return w.user_size(tag, "notes.bin")

            async def read(off, n):
                return await w.read_user(tag, "notes.bin", off, n)
        assert await write(tag, MAX_GROWN - 10, b"y" * 8192) == 10
        assert size(tag) == MAX_GROWN
        assert await read(MAX_GROWN - 12, 12) == b"\0\0" + b"y" * 10
        with pytest.raises(FaultfsError) as err:
            await write(tag, MAX_GROWN, b"z")
        assert err.value.errno == errno.EFBIG
        assert size(tag) == MAX_GROWN

    trio.run(main)



def test_a_base_fault_that_fails_behind_a_write_is_eio_to_reads_then_retried(store):
    """The write is acknowledged (its bytes are journaled); its base fault fails: a read is
    EIO, never zeros or the written bytes alone, and the next read faults it again."""
    data, src, eng, tag = _writing_engine(store, 2)
    src.fail_calls = {1, 2}
    want = bytearray(data[CS:])
    want[10:13] = b"abc"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.writes.write_chunk(tag, 1, 10, b"abc")
                await settle(eng)
                assert eng.stats.counters["base_fault_errors"] == 1
                with pytest.raises(FaultfsError) as err:
                    await eng.read_blob(tag, 1, 0, CS)
                assert err.value.errno == errno.EIO
                assert await eng.read_blob(tag, 1, 0, CS) == want
                await eng.writes.checkpoint()
            assert await eng.read_blob(tag, 1, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_source_changed_before_a_written_base_was_read_damages_that_blob_only(store):
    """The write is acknowledged, then the source changes under the mount before its base
    fault lands: the blob is damaged (EIO naming why, kept across the remount), never its
    write laid over the new version; the other blobs' checkpoints go on; a reset recovers."""
    data, src, eng, tag = _writing_engine(store, 3, gated=True)
    ok = bytearray(data[:CS])
    ok[0:2] = b"ok"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.writes.write_chunk(tag, 1, 9, b"lost base")
                src.changed = "rewritten in place"
                src.gate.set()
                await settle(eng)
                await eng.writes.write_chunk(tag, 2, 0, b"z" * CS)  # whole: needs no base
                await eng.writes.checkpoint()
                assert eng.stats.counters["checkpoints"] == 1, "the others still fold"
                with pytest.raises(FaultfsError) as err:
                    await eng.read_blob(tag, 1, 0, CS)
                assert err.value.errno == errno.EIO and "source changed" in str(err.value)
                assert await eng.read_blob(tag, 2, 0, CS) == b"z" * CS
                await eng.close_writes()
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()
    eng2, tag2, new = _recovered_over_a_new_version(store, data)

    async def after():
        with pytest.raises(FaultfsError) as err:
            await eng2.read_blob(tag2, 1, 0, CS)
        assert err.value.errno == errno.EIO, "never the new version under the old write"
        assert await eng2.read_blob(tag2, 2, 0, CS) == b"z" * CS
        assert await eng2.writes.reset(tag2, ["chunk_1"]) == 1
        assert await eng2.read_blob(tag2, 1, 0, CS) == new[CS:2 * CS]

    trio.run(after)
    eng2.close()


@pytest.mark.parametrize("synced", [False, True], ids=["kill", "fsync-then-kill"])
def test_writes_over_a_base_never_staged_are_damaged_when_the_source_changed_by_the_remount(
        store, synced):
    """A kill before the base fault landed, then the source changes before the remount: the
    replayed writes would lie over the new version's bytes. The chunk is damaged instead
    (EIO, kept), and stays so after a second remount (saved before the new version is
    recorded); an untouched chunk reads the new version."""
    data, src, eng, tag = _writing_engine(store, 2, gated=True)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.writes.write_chunk(tag, 0, 3, b"old")
            if synced:
                await eng.writes.fsync()
            assert not eng.is_staged(tag, 0)
            nursery.cancel_scope.cancel()  # the kill: the fault never lands

    trio.run(main)
    src.gate.set()
    eng.close()
    new = bytes(reversed(data))
    for _ in range(2):
        src2 = make_source(new)
        src2.token = "v2"
        eng2 = engine_for(store, memory_mb=1, prefetch_mb=0)
        [tag2] = eng2.recover()

        async def after(eng2, tag2):
            with pytest.raises(FaultfsError) as err:
                await eng2.read_blob(tag2, 0, 0, CS)
            assert err.value.errno == errno.EIO and "not staged before" in str(err.value)
            assert await eng2.read_blob(tag2, 1, 0, CS) == new[CS:]

        trio.run(after, eng2, tag2)
        eng2.close()


def test_a_base_that_cannot_be_read_holds_back_only_its_own_records(store):
    """The base of one dirty blob cannot be faulted (the source fails for a while): the
    checkpoint folds every other blob and lets the journal go up to that blob's records;
    once the source reads again, the next checkpoint folds it too."""
    data, src, eng, tag = _writing_engine(store, 3)
    src.fail_calls = {1, 2}  # the base fault, and the first checkpoint's fold of it
    want = bytearray(data[:CS])
    want[5:8] = b"abc"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(10):
                await eng.writes.write_chunk(tag, 0, 5, b"abc")
                await settle(eng)
                for _ in range(50):
                    await eng.writes.write_chunk(tag, 1, 0, b"q" * CS)
                before = eng.writes.journal.bytes_on_disk
                await eng.writes.checkpoint()
                assert eng.stats.counters["checkpoints"] == 1 and src.failures == 2
                assert eng.writes.table.blobs[(tag.id, "chunk_1")].base is Base.FOLDED
                assert eng.writes.table.blobs[(tag.id, "chunk_0")].base is Base.CLEAN
                await eng.writes.checkpoint()
                assert eng.writes.table.blobs[(tag.id, "chunk_0")].base is Base.FOLDED
                assert eng.writes.journal.bytes_on_disk < before
                assert await eng.read_blob(tag, 0, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_read_then_a_partial_write_of_the_chunk_reads_the_source_once(store):
    """Read-modify-write (numpy.memmap r+): the write's base is the read's fault, held in
    memory while its store write is pending, not a second source read; it ends up pinned."""
    data, src, eng, tag = _writing_engine(store, 4)
    want = bytearray(data[CS:2 * CS])
    want[10:11] = b"x"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.read_blob(tag, 1, 0, CS)
            await eng.writes.write_chunk(tag, 1, 10, b"x")
            await settle(eng)
            assert (tag.id, 1) in eng.tiers.local._pinned and eng.is_staged(tag, 1)
            assert await eng.read_blob(tag, 1, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads == 1


@pytest.mark.parametrize("skips", [1, 1000], ids=["once", "always"])
def test_a_written_base_the_store_did_not_keep_is_stored_again_or_faulted_again(store, skips):
    """The store write behind a partial write skipped the base once (then it is stored once
    more, behind the writer) or every time (then it is clean bytes: a later read or fold
    faults it again, and the written bytes are never lost or served as zeros)."""
    data = payload(CS * 4)
    make_source(data)
    eng = engine_for(store, memory_mb=0, prefetch_mb=0)
    tag = eng.register(ctx_for())
    left = [skips]

    async def skip(key):
        if left[0]:
            left[0] -= 1
            return StoreOutcome.SKIPPED_CACHE_CAP
        return None

    _put_through(eng, skip)
    want = bytearray(data[2 * CS:3 * CS])
    want[CS - 8:] = b"y" * 8

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.writes.write_chunk(tag, 2, CS - 8, b"y" * 8)
            await settle(eng)
            assert eng.is_staged(tag, 2) == (skips == 1)
            assert await eng.writes.read_chunk(tag, 2, 0, CS) == want
            await eng.writes.checkpoint()  # the fold reads the base (faulted again if need be)
            assert await eng.writes.read_chunk(tag, 2, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    # always: the write's fault, then the read's and the fold's (read-through, like --no-store)
    assert eng.stats.counters["faults"] == (1 if skips == 1 else 3)


def test_a_write_that_lands_while_a_reset_saves_its_state_is_the_same_live_and_replayed(store):
    """A write answered while ``faultfs reset`` of its tag is saving the state: what the
    mount shows of it afterwards is what a replay after a kill -9 shows."""
    data, _src, eng, tag = _writing_engine(store, 2)
    real = eng.writes.files.write_state

    async def main():
        await eng.writes.write_chunk(tag, 0, 0, b"before")
        gate = threading.Event()

        def slow_state(name, state):
            gate.wait(5)
            real(name, state)

        eng.writes.files.write_state = slow_state
        async with trio.open_nursery() as nursery:
            nursery.start_soon(eng.writes.reset, tag)
            await trio.sleep(0.05)  # the reset is saving its state
            await eng.writes.write_chunk(tag, 0, 10, b"during")  # answered
            gate.set()
        eng.writes.files.write_state = real
        return bytes(await eng.read_blob(tag, 0, 0, 16))

    live = trio.run(main)
    eng.writes.journal.sync()
    eng2 = engine_for(store, memory_mb=1, prefetch_mb=0)  # as after a kill -9: a replay
    [tag2] = eng2.recover()
    replayed = bytes(trio.run(eng2.read_blob, tag2, 0, 0, 16))
    assert live == replayed, (live, replayed)
    assert live == data[:10] + b"during", "it lies over the reset: the source's bytes beneath"


def _state_saves_fail(eng, gate=None):
    """Make the next state save of the engine's writes fail (EIO; after ``gate`` is set,
    when given); later ones write as before. The list of the states it refused."""
    real = eng.writes.files.write_state
    refused = []

    def write_state(name, state):
        if refused:
            return real(name, state)
        refused.append(state)
        if gate is not None:
            gate.wait(5)
        raise OSError(errno.EIO, "Input/output error")

    eng.writes.files.write_state = write_state
    return refused


@pytest.mark.parametrize("change", ["create", "unlink", "rename"])
def test_a_user_blob_table_change_whose_save_fails_changes_nothing(store, change):
    """Creating, unlinking or renaming a user blob whose state save fails (EIO) is refused
    and changes nothing: not in this mount, not at the tag's next state save, not after a
    remount."""
    _, _, eng, tag = _writing_engine(store, 1)
    w = eng.writes

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await w.create_user(tag, "a.txt")
                await w.write_user(tag, "a.txt", 0, b"kept")
                _state_saves_fail(eng)
                attempt = {"create": lambda: w.create_user(tag, "b.txt"),
                           "unlink": lambda: w.unlink_user(tag, "a.txt"),
                           "rename": lambda: w.rename_user(tag, "a.txt", "b.txt")}[change]
                with pytest.raises(FaultfsError) as err:
                    await attempt()
                assert err.value.errno == errno.EIO
                assert w.user_names(tag) == ["a.txt"]
                await w.create_user(tag, "c.txt")  # the tag's next state save
                assert sorted(w.user_names(tag)) == ["a.txt", "c.txt"]
                assert bytes(await w.read_user(tag, "a.txt", 0, 10)) == b"kept"
                await eng.close_writes()
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()
    eng2 = engine_for(store, memory_mb=1, prefetch_mb=0)
    [tag2] = eng2.recover()
    assert sorted(eng2.writes.user_names(tag2)) == ["a.txt", "c.txt"]
    assert bytes(trio.run(eng2.writes.read_user, tag2, "a.txt", 0, 10)) == b"kept"
    eng2.close()


async def _tag_as_shown(eng, tag):
    """What a tag shows: its view (bytes and size), its user blobs (names and bytes), its
    mtime."""
    w = eng.writes
    size = w.view_size(tag)
    users = {name: bytes(await w.read_user(tag, name, 0, 1 << 20)) for name in w.user_names(tag)}
    return bytes(await eng.read_view(tag, 0, size)), size, users, w.mtime_ns(tag)


def _shown_after_a_kill_and_after_an_unmount(store, eng):
    """What the engine's one tag shows at a remount after a kill -9 (the journal replayed),
    then at one after a clean unmount of that."""
    eng.writes.journal.sync()
    eng.close()  # no close_writes: as after a kill -9
    shown = []
    for _ in range(2):
        again = engine_for(store, memory_mb=1, prefetch_mb=0)
        again.writes.user_part = eng.writes.user_part
        [tag] = again.recover()

        async def show(e=again, t=tag):
            got = await _tag_as_shown(e, t)
            await e.close_writes()
            return got

        shown.append(trio.run(show))
        again.close()
    return shown


async def _written_every_way(eng, tag):
    """Writes of every kind a reset drops: a partial write over the source (chunk 0), one
    over a folded file (chunk 1), a whole chunk (chunk 2), the view grown (chunk 4), and a
    user blob "f" of two parts."""
    w = eng.writes
    await w.write_chunk(tag, 1, 7, b"folded")
    await w.checkpoint()
    await w.write_chunk(tag, 1, 100, b"over the fold")
    await w.write_chunk(tag, 0, 5, b"partial")
    await w.write_chunk(tag, 2, 0, bytes(reversed(payload(CS))))
    await w.write_view(tag, 4 * CS + 50, b"g" * 50)
    await w.create_user(tag, "f")
    await w.write_user(tag, "f", 10, b"u" * (w.user_part + 20))
    await settle(eng)


RESET_ALL = ["chunk_0", "chunk_1", "chunk_2", "chunk_4", "f"]


@pytest.mark.parametrize("which", ["tag", "blobs"])
def test_a_reset_whose_state_save_fails_changes_nothing(store, which):
    """``faultfs reset`` whose state save fails changed nothing: the mount shows every write
    it would have dropped (over the source, over a fold, whole chunks, the grown view, user
    blobs), with the same pins and counters, and a later state save of the tag, a remount
    after a kill -9 and one after an unmount show the same (never the reset's void marks)."""
    _data, _src, eng, tag = _writing_engine(store, 4)
    w = eng.writes
    w.user_part = CS

    def counters():
        tw = w.tags[tag.id]
        return (w.held, w.table.direct_count, w.dirty_summary(tag), set(eng.tiers.local._pinned),
                tag.id in w.changed, tw.voided, dict(tw.voided_blobs), w.has_writes(tag))

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(10):
                await _written_every_way(eng, tag)
                before, kept = await _tag_as_shown(eng, tag), counters()
                assert (tag.id, 0) in eng.tiers.local._pinned
                refused = _state_saves_fail(eng)
                with pytest.raises(FaultfsError) as err:
                    await w.reset(tag, None if which == "tag" else RESET_ALL)
                assert err.value.errno == errno.EIO and refused
                assert await _tag_as_shown(eng, tag) == before
                assert counters() == kept
                await w.create_user(tag, "g")  # a later state save of the tag
                assert w.files.read_state(tag.name)["voided"] == 0
                assert w.files.read_state(tag.name)["voided_blobs"] == {}
                shown = await _tag_as_shown(eng, tag)
                assert shown[0] == before[0] and set(shown[2]) == {"f", "g"}
            nursery.cancel_scope.cancel()
        return shown

    shown = trio.run(main)
    assert _shown_after_a_kill_and_after_an_unmount(store, eng) == [shown, shown]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["", "checkpoint"])
@pytest.mark.parametrize("which", ["tag", "blobs"])
def test_writes_answered_while_a_reset_fails_to_save_lie_over_the_writes_it_kept(
        store, which, checkpoint):
    """Writes answered while a reset saves the state that then fails went to blobs of their
    own (the reset's, then): they end up over the writes the failed reset kept, as a replay
    applies the old records and then theirs — a partial write over a partial one, a whole
    chunk over a partial write, a partial write over a whole chunk, the view grown again, a
    user blob written, cut and written again. A checkpoint and a user blob made meanwhile
    wait for the reset. The mount, a remount after a kill -9 and one after an unmount agree."""
    data, _src, eng, tag = _writing_engine(store, 4)
    w = eng.writes
    w.user_part = CS
    whole = bytes(reversed(payload(CS)))
    new_whole = b"W" * CS
    gate = threading.Event()

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(10):
                await _written_every_way(eng, tag)
                refused = _state_saves_fail(eng, gate)
                failed = trio.Event()

                async def reset():
                    with pytest.raises(FaultfsError):
                        await w.reset(tag, None if which == "tag" else RESET_ALL)
                    failed.set()

                nursery.start_soon(reset)
                await trio.sleep(0.05)
                assert refused, "the reset is saving its state"
                await w.write_chunk(tag, 0, 8, b"NEW")
                await w.write_chunk(tag, 1, 0, new_whole)
                await w.write_chunk(tag, 2, 3, b"over the whole")
                await w.write_view(tag, 4 * CS + 10, b"v" * 5)
                if which == "blobs":  # (a reset of the tag unlinked it meanwhile)
                    await w.write_user(tag, "f", 30, b"F" * 20)
                    await w.truncate_user(tag, "f", 35)
                    await w.write_user(tag, "f", 45, b"T" * 5)
                if checkpoint:
                    nursery.start_soon(w.checkpoint)
                nursery.start_soon(w.create_user, tag, "g")
                await trio.sleep(0.05)
                assert "g" not in w.user_names(tag), "table changes wait for the reset"
                gate.set()
                await failed.wait()
                await settle(eng)
                await trio.sleep(0.05)
                await w.checkpoint()  # (after the one started meanwhile)
            shown = await _tag_as_shown(eng, tag)
            nursery.cancel_scope.cancel()
        return shown

    shown = trio.run(main)
    want = bytearray(data)
    want[5:12] = b"partial"
    want[8:11] = b"NEW"
    want[CS:2 * CS] = new_whole
    want[2 * CS:3 * CS] = whole
    want[2 * CS + 3:2 * CS + 17] = b"over the whole"
    grown = bytearray(100)
    grown[50:100] = b"g" * 50
    grown[10:15] = b"v" * 5
    if which == "tag":  # the view grew again from the reset's size: its last size
        want += grown[:15]
    else:
        want += grown
    user = bytearray(10) + b"u" * (CS + 20)
    if which == "blobs":  # cut at 35: in its first part (the reset had dropped the second)
        user[30:CS] = b"F" * 5 + bytes(10) + b"T" * 5 + bytes(CS - 50)
    assert shown[0] == bytes(want)
    assert shown[1] == len(want)
    assert shown[2] == {"f": bytes(user), "g": b""}
    assert _shown_after_a_kill_and_after_an_unmount(store, eng) == [shown, shown]


@pytest.mark.parametrize("waits", ["fault", "lock", "whole", "truncate"])
def test_a_write_that_waits_while_a_reset_drops_its_blob_lands_where_a_replay_puts_it(store,
                                                                                      waits):
    """A write that awaits after it was handed its blob — its base's fault (no nursery: the
    write faults it itself), the blob's lock (held by that write), for a partial or a whole
    chunk, or a shrink of the view — while a reset of the tag drops the blob: its record
    comes after the reset's void mark, so it lands in the blob the tables have for the name
    now (made as a replay makes it), over the source's bytes; the mount, a remount after a
    kill -9 and one after an unmount agree, and the chunk stays pinned under it."""
    data, src, eng, tag = _writing_engine(store, 2, gated=True)
    w = eng.writes
    whole = b"W" * CS

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.write_chunk, tag, 0, 5, b"abc")
                await trio.sleep(0.05)
                assert w.is_dirty(tag, 0), "waiting for its base, chunk 0's lock held"
                if waits == "lock":
                    nursery.start_soon(w.write_chunk, tag, 0, 20, b"xyz")
                elif waits == "whole":
                    nursery.start_soon(w.write_chunk, tag, 0, 0, whole)
                elif waits == "truncate":
                    nursery.start_soon(w.truncate_view, tag, 10)
                await trio.sleep(0.05)
                assert await w.reset(tag) == 1
                src.gate.set()
            if waits == "truncate":  # grown again: zeros past the cut, never the old bytes
                await w.truncate_view(tag, CS)
            blob = w.table.blobs.get((tag.id, "chunk_0"))
            assert blob is not None, "the write is in the tables (not in the dropped blob)"
            assert blob.writers == 0
            # pinned under the writes; a whole chunk written last has no clean base
            assert ((tag.id, 0) in eng.tiers.local._pinned) == (blob.base is Base.CLEAN)
            return await _tag_as_shown(eng, tag)

    shown = trio.run(main)
    want = bytearray(data[:CS])
    want[5:8] = b"abc"
    if waits == "lock":
        want[20:23] = b"xyz"
    got = shown[0][:CS]
    if waits == "whole":  # (either may take the lock first)
        assert got in (whole, whole[:5] + b"abc" + whole[8:])
    elif waits == "truncate":
        assert shown[:2] == (bytes(want[:10]) + bytes(CS - 10), CS)
    else:
        assert got == bytes(want)
        assert shown[0][CS:] == data[CS:]
    # (the mtime a write sets is saved with the next state, not journaled: a kill's is older)
    again = _shown_after_a_kill_and_after_an_unmount(store, eng)
    assert [got[:3] for got in again] == [shown[:3], shown[:3]]


def test_a_user_blob_cut_that_waits_while_a_reset_drops_its_part_lands_where_a_replay_puts_it(
        store):
    """A truncate of a user blob that waits for its part's lock (a fold holds it) while a
    reset of the blob drops that part: the cut is journaled after the void mark, so it sizes
    the part the tables have now, as a replay does — the blob is that long, in zeros, also
    once a write made it work its size out again."""
    _data, _src, eng, tag = _writing_engine(store, 2)
    w = eng.writes

    async def main():
        with trio.fail_after(10):
            await w.create_user(tag, "f")
            await w.write_user(tag, "f", 0, b"u" * 100)
            async with trio.open_nursery() as nursery:
                async with w.table.blobs[(tag.id, "u:1")].locked():  # as a fold holds it
                    nursery.start_soon(w.truncate_user, tag, "f", 50)
                    await trio.sleep(0.05)
                    assert await w.reset(tag, ["f"]) == 1
            await w.write_user(tag, "f", 10, b"x")
            return await _tag_as_shown(eng, tag)

    shown = trio.run(main)
    assert shown[2] == {"f": bytes(10) + b"x" + bytes(39)}
    again = _shown_after_a_kill_and_after_an_unmount(store, eng)
    assert [got[:3] for got in again] == [shown[:3], shown[:3]]
