"""Group commit (``engine/writes/sync.py``): fsyncs that queue behind a sync are answered by
it, and one called after a write made during a sync syncs again. The journal's syncs are made
slow through the file operations (``FaultyOps``)."""

from __future__ import annotations

import pytest
import trio

from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS
from faultfs.testing.writing import slow_journal_syncs, writing_engine


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def test_fsyncs_queued_behind_a_sync_are_answered_by_it(store):
    """Group commit: eight writers fsyncing at once after their writes cost one journal sync
    (it began after every write), and the other seven are answered by it."""
    _, _, eng, tag, ops = writing_engine(store, 8)
    began = slow_journal_syncs(eng, ops)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            for i in range(8):
                await eng.write_chunk(tag, i, 0, b"w" * CS)  # whole: no base fault
                await eng.write_chunk(tag, i, 7, b"x")
            last = eng.writes.journal.next_seq
            with trio.fail_after(5):
                async with trio.open_nursery() as writers:
                    for _ in range(8):
                        writers.start_soon(eng.fsync)
            assert began == [last]
            nursery.cancel_scope.cancel()

    trio.run(main)
    c = eng.stats.counters
    assert c["fsyncs"] == 8 and c["fsyncs_joined"] == 7
    eng.close()


def test_an_fsync_after_a_write_made_during_a_sync_syncs_again(store):
    """A sync under way began before this write: an fsync after the write waits for it and
    then syncs again, never answered by the older sync."""
    _, _, eng, tag, ops = writing_engine(store, 2)
    began = slow_journal_syncs(eng, ops)
    order = []

    async def first():
        await eng.fsync()
        order.append("first")

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            await eng.write_chunk(tag, 0, 0, b"a" * CS)
            with trio.fail_after(5):
                async with trio.open_nursery() as writers:
                    writers.start_soon(first)
                    while not began:  # noqa: ASYNC110 - filled on a worker thread (50 ms sync)
                        await trio.sleep(0.001)
                    assert not order
                    await eng.write_chunk(tag, 1, 0, b"b" * CS)
                    written = eng.writes.journal.next_seq
                    await eng.fsync()
                    order.append("second")
            assert len(began) == 2 and began[1] >= written
            assert order == ["first", "second"]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert eng.stats.counters["fsyncs_joined"] == 0
    eng.close()

