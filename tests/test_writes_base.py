"""The clean base under a partial write (``engine/writes/base.py``): the size-0 request behind
the write, bounded; pins taken and let go (a reset, a whole rewrite, a fold or a refused write
while the base faults); a base fault that fails, or a source that changed before the base was
staged (damaged, never laid over the new version); a read-modify-write that reads the source
once; a base the store did not keep. Failures come from the source (``fakes.py``) and the
file operations (``FaultyOps``), never from the engine's insides."""

from __future__ import annotations

import errno

import pytest
import trio

from faultfs.engine.writes import BASE_FAULTS
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload
from faultfs.testing.writing import (
    full_journal,
    put_through,
    recovered_over_a_new_version,
    settle,
    writing_engine,
)
from faultfs.tiers.base import StoreOutcome


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def test_a_partial_write_of_an_unstaged_chunk_is_answered_before_its_fault(store):
    """The size-0 request is issued behind the write: the write is journaled and answered
    while the source read is held at a gate; a read meanwhile joins that fault (one source
    read); the base ends up staged and pinned, beneath the written bytes."""
    data, src, eng, tag, _ops = writing_engine(store, 4, gated=True)
    want = bytearray(data[CS:2 * CS])
    want[100:110] = b"x" * 10
    got = []

    async def reader():
        got.append(bytes(await eng.read_blob(tag, 1, 0, CS)))

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.write_chunk(tag, 1, 100, b"x" * 10)
                assert eng.writes.base_faults == 1 and eng.busy
                nursery.start_soon(reader)
                await trio.sleep(0.05)
                assert not got, "the read waits for the base, at the gate"
            src.gate.set()
            await settle(eng)
            assert got == [want]
            assert eng.is_staged(tag, 1) and eng.tiers.local.pinned((tag.id, 1))
            assert await eng.read_blob(tag, 1, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads == 1 and eng.stats.counters["faults"] == 1


def test_size_0_requests_behind_writes_are_bounded_past_that_the_write_waits(store):
    """At most BASE_FAULTS base faults run behind writes; the next partial write of another
    unstaged chunk faults its base itself before it is answered."""
    n = BASE_FAULTS + 1
    data, src, eng, tag, _ops = writing_engine(store, n + 1, gated=True)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                for i in range(BASE_FAULTS):
                    await eng.write_chunk(tag, i, 7, b"w")
                assert eng.writes.base_faults == BASE_FAULTS
            done = trio.Event()

            async def last():
                await eng.write_chunk(tag, BASE_FAULTS, 7, b"w")
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
                assert eng.tiers.local.pinned((tag.id, i))
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads == n


@pytest.mark.parametrize("then", ["reset", "whole", "fold"])
def test_a_blob_reset_rewritten_or_folded_while_its_base_faults_leaves_no_pin(store, then):
    """The base fault behind a write lands after the blob was reset, written whole or
    folded: the staged copy it pinned is let go (evictable again), the bytes are right."""
    data, src, eng, tag, _ops = writing_engine(store, 2, gated=True)
    want = bytearray(data[:CS])

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.write_chunk(tag, 0, 5, b"abc")
                if then == "reset":
                    assert await eng.writes.reset(tag) == 1
                elif then == "whole":
                    want[:] = b"z" * CS
                    await eng.write_chunk(tag, 0, 0, b"z" * CS)
                else:
                    want[5:8] = b"abc"
                    nursery.start_soon(eng.writes.checkpoint)  # its fold joins the fault
                    await trio.sleep(0.05)
            src.gate.set()
            await settle(eng)
            with trio.fail_after(5):
                await eng.writes.checkpoint()
            assert eng.writes.base_faults == 0
            assert not eng.tiers.local.pinned((tag.id, 0))
            assert await eng.read_blob(tag, 0, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert src.reads <= 2


@pytest.mark.parametrize("staged", [True, False])
def test_a_refused_write_leaves_its_chunk_unpinned_and_the_source_bytes_in_place(store,
                                                                                  staged):
    """A partial write the store has no room for (ENOSPC from the journal): the pin its
    size-0 request took of the staged chunk (or the one its base fault takes when it lands)
    is let go, so the chunk stays evictable; it reads the source's bytes; the next write
    pins it again."""
    data, src, eng, tag, ops = writing_engine(store, 2, gated=not staged)
    room = full_journal(ops).on()
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
                    await eng.write_chunk(tag, 0, 5, b"abc")
                assert err.value.errno == errno.ENOSPC
                if not staged:
                    assert eng.writes.base_faults == 1
                    src.gate.set()
                await settle(eng)
                assert not eng.tiers.local.pinned(key)
                assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                room.off()
                await eng.write_chunk(tag, 0, 5, b"abc")
                await settle(eng)
                assert eng.tiers.local.pinned(key)
                want = bytearray(data[:CS])
                want[5:8] = b"abc"
                assert await eng.read_blob(tag, 0, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_base_fault_that_fails_behind_a_write_is_eio_to_reads_then_retried(store):
    """The write is acknowledged (its bytes are journaled); its base fault fails: a read is
    EIO, never zeros or the written bytes alone, and the next read faults it again."""
    data, src, eng, tag, _ops = writing_engine(store, 2)
    src.fail_calls = {1, 2}
    want = bytearray(data[CS:])
    want[10:13] = b"abc"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.write_chunk(tag, 1, 10, b"abc")
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
    data, src, eng, tag, _ops = writing_engine(store, 3, gated=True)
    ok = bytearray(data[:CS])
    ok[0:2] = b"ok"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.write_chunk(tag, 1, 9, b"lost base")
                src.changed = "rewritten in place"
                src.gate.set()
                await settle(eng)
                await eng.write_chunk(tag, 2, 0, b"z" * CS)  # whole: needs no base
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
    eng2, tag2, new = recovered_over_a_new_version(store, data)

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
    data, src, eng, tag, _ops = writing_engine(store, 2, gated=True)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.write_chunk(tag, 0, 3, b"old")
            if synced:
                await eng.fsync()
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


def test_a_read_then_a_partial_write_of_the_chunk_reads_the_source_once(store):
    """Read-modify-write (numpy.memmap r+): the write's base is the read's fault, held in
    memory while its store write is pending, not a second source read; it ends up pinned."""
    data, src, eng, tag, _ops = writing_engine(store, 4)
    want = bytearray(data[CS:2 * CS])
    want[10:11] = b"x"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.read_blob(tag, 1, 0, CS)
            await eng.write_chunk(tag, 1, 10, b"x")
            await settle(eng)
            assert eng.tiers.local.pinned((tag.id, 1)) and eng.is_staged(tag, 1)
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

    put_through(eng, skip)
    want = bytearray(data[2 * CS:3 * CS])
    want[CS - 8:] = b"y" * 8

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.write_chunk(tag, 2, CS - 8, b"y" * 8)
            await settle(eng)
            assert eng.is_staged(tag, 2) == (skips == 1)
            assert await eng.writes.read_chunk(tag, 2, 0, CS) == want
            await eng.writes.checkpoint()  # the fold reads the base (faulted again if need be)
            assert await eng.writes.read_chunk(tag, 2, 0, CS) == want
            nursery.cancel_scope.cancel()

    trio.run(main)
    # always: the write's fault, then the read's and the fold's (read-through, like --no-store)
    assert eng.stats.counters["faults"] == (1 if skips == 1 else 3)
