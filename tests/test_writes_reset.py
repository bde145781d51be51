"""Resets (``engine/writes/reset.py``): a write answered while a reset syncs its record lands
where a replay puts it, over the reset; a reset the journal has no room for changes nothing
(pinned and counted as before); a change that waited while a reset dropped its blob lands in
the blob the table has then. The full journal and the slow sync are rules of the file
operations (``FaultyOps``)."""

from __future__ import annotations

import errno
import threading

import pytest
import trio

from faultfs.engine.writes import Base
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, engine_for
from faultfs.testing.writing import (
    JOURNAL,
    RESET_ALL,
    full_journal,
    settle,
    shown_after_a_kill_and_after_an_unmount,
    tag_as_shown,
    writing_engine,
    written_every_way,
)


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def journal_syncs_wait(ops, gate: threading.Event):
    """The journal's syncs wait (on their I/O thread) for ``gate``."""
    return ops.when("fsync", JOURNAL, lambda path: gate.wait(5))


def test_a_write_that_lands_while_a_reset_syncs_its_record_is_the_same_live_and_replayed(store):
    """A write answered while ``faultfs reset`` of its tag waits for its record's sync: it
    lies over the reset, and what the mount shows of it is what a replay after a kill -9
    shows."""
    data, _src, eng, tag, ops = writing_engine(store, 2)

    async def main():
        await eng.write_chunk(tag, 0, 0, b"before")
        gate = threading.Event()
        slow = journal_syncs_wait(ops, gate)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(eng.reset, tag)
            await trio.sleep(0.05)
            assert slow.matched, "the reset is syncing its record"
            await eng.write_chunk(tag, 0, 10, b"during")  # answered
            gate.set()
        slow.off()
        return bytes(await eng.read_blob(tag, 0, 0, 16))

    live = trio.run(main)
    eng.writes.journal.sync()
    eng2 = engine_for(store, memory_mb=1, prefetch_mb=0)  # as after a kill -9: a replay
    [tag2] = eng2.recover()
    replayed = bytes(trio.run(eng2.read_blob, tag2, 0, 0, 16))
    assert live == replayed, (live, replayed)
    assert live == data[:10] + b"during", "it lies over the reset: the source's bytes beneath"


@pytest.mark.parametrize("which", ["tag", "blobs"])
def test_a_reset_the_journal_has_no_room_for_changes_nothing(store, which):
    """``faultfs reset`` whose record cannot be appended (ENOSPC) changed nothing: the mount
    shows every write it would have dropped (over the source, over a fold, whole chunks, the
    grown view, user blobs), with the same pins and counters, and a later state save of the
    tag, a remount after a kill -9 and one after an unmount show the same (never a void
    mark)."""
    _data, _src, eng, tag, ops = writing_engine(store, 4)
    w = eng.writes
    w.user_part = CS

    def counters():
        tw = w.tags[tag.id]
        pinned = {i for i in range(8) if eng.tiers.local.pinned((tag.id, i))}
        return (w.held, w.table.direct_count, w.dirty_summary(tag), pinned,
                tag.id in w.changed, tw.voided, dict(tw.voided_blobs), w.has_writes(tag))

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(10):
                await written_every_way(eng, tag)
                before, kept = await tag_as_shown(eng, tag), counters()
                assert eng.tiers.local.pinned((tag.id, 0))
                full = full_journal(ops).on()
                with pytest.raises(FaultfsError) as err:
                    await w.reset(tag, None if which == "tag" else RESET_ALL)
                assert err.value.errno == errno.ENOSPC and full.acted
                full.off()
                assert await tag_as_shown(eng, tag) == before
                assert counters() == kept
                await w.create_user(tag, "g")
                await w.checkpoint()  # a later state save of the tag
                assert w.files.read_state(tag.name)["voided"] == 0
                assert w.files.read_state(tag.name)["voided_blobs"] == {}
                shown = await tag_as_shown(eng, tag)
                assert shown[0] == before[0] and set(shown[2]) == {"f", "g"}
            nursery.cancel_scope.cancel()
        return shown

    shown = trio.run(main)
    assert shown_after_a_kill_and_after_an_unmount(store, eng) == [shown, shown]


@pytest.mark.parametrize("checkpoint", [False, True], ids=["", "checkpoint"])
@pytest.mark.parametrize("which", ["tag", "blobs"])
def test_writes_answered_while_a_reset_syncs_lie_over_it(store, which, checkpoint):
    """Writes answered while a reset waits for its record's sync go to blobs of their own
    (the reset was made when its record was appended): a partial write, a whole chunk, a
    partial write over a whole chunk, the view grown again, a user blob made and written;
    a checkpoint may run meanwhile. The mount, a remount after a kill -9 and one after an
    unmount agree, and nothing the reset dropped comes back."""
    data, _src, eng, tag, ops = writing_engine(store, 4)
    w = eng.writes
    w.user_part = CS
    new_whole = b"W" * CS
    gate = threading.Event()

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(10):
                await written_every_way(eng, tag)
                slow = journal_syncs_wait(ops, gate)
                done = trio.Event()

                async def reset():
                    await w.reset(tag, None if which == "tag" else RESET_ALL)
                    done.set()

                nursery.start_soon(reset)
                await trio.sleep(0.05)
                assert slow.matched and not done.is_set(), "the reset is syncing its record"
                slow.off()  # (the writes' own syncs go through)
                await w.write_chunk(tag, 0, 8, b"NEW")
                await w.write_chunk(tag, 1, 0, new_whole)
                await w.write_chunk(tag, 2, 3, b"over the source")
                await w.write_view(tag, 4 * CS + 10, b"v" * 5)
                await w.create_user(tag, "g")
                await w.write_user(tag, "g", 3, b"G")
                if checkpoint:
                    nursery.start_soon(w.checkpoint)
                gate.set()
                await done.wait()
                await settle(eng)
                await w.checkpoint()
            shown = await tag_as_shown(eng, tag)
            nursery.cancel_scope.cancel()
        return shown

    shown = trio.run(main)
    want = bytearray(data)
    want[8:11] = b"NEW"
    want[CS:2 * CS] = new_whole
    want[2 * CS + 3:2 * CS + 18] = b"over the source"
    if which == "tag":  # the view grew again from the source's size
        want += bytes(10) + b"v" * 5
    else:  # (a reset of blobs keeps the view's size)
        grown = bytearray(100)
        grown[10:15] = b"v" * 5
        want += grown
    users = {"g": b"\0\0\0G"}
    if which == "blobs":
        users["f"] = b""  # back to empty
    assert shown[0] == bytes(want)
    assert shown[1] == len(want)
    assert shown[2] == users
    assert shown_after_a_kill_and_after_an_unmount(store, eng) == [shown, shown]


@pytest.mark.parametrize("waits", ["fault", "lock", "whole", "truncate"])
def test_a_write_that_waits_while_a_reset_drops_its_blob_lands_where_a_replay_puts_it(store,
                                                                                      waits):
    """A write that awaits after it was handed its blob — its base's fault (no nursery: the
    write faults it itself), the blob's lock (held by that write), for a partial or a whole
    chunk, or a shrink of the view — while a reset of the tag drops the blob: its record
    comes after the reset's void mark, so it lands in the blob the tables have for the name
    now (made as a replay makes it), over the source's bytes; the mount, a remount after a
    kill -9 and one after an unmount agree, and the chunk stays pinned under it."""
    data, src, eng, tag, _ops = writing_engine(store, 2, gated=True)
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
            assert eng.tiers.local.pinned((tag.id, 0)) == (blob.base is Base.CLEAN)
            return await tag_as_shown(eng, tag)

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
    again = shown_after_a_kill_and_after_an_unmount(store, eng)
    assert [got[:3] for got in again] == [shown[:3], shown[:3]]


def test_a_user_blob_cut_that_waits_while_a_reset_drops_its_part_lands_where_a_replay_puts_it(
        store):
    """A truncate of a user blob that waits for its part's lock (a fold holds it) while a
    reset of the blob drops that part: the cut is journaled after the void mark, so it sizes
    the part the tables have now, as a replay does — the blob is that long, in zeros, also
    once a write made it work its size out again."""
    _data, _src, eng, tag, _ops = writing_engine(store, 2)
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
            return await tag_as_shown(eng, tag)

    shown = trio.run(main)
    assert shown[2] == {"f": bytes(10) + b"x" + bytes(39)}
    again = shown_after_a_kill_and_after_an_unmount(store, eng)
    assert [got[:3] for got in again] == [shown[:3], shown[:3]]
