"""Checkpoints (``engine/writes/checkpoint.py``): a blob whose base cannot be read holds back
only its own records; the others fold and the journal is let go up to it."""

from __future__ import annotations

import pytest
import trio

from faultfs.engine.writes import Base
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS
from faultfs.testing.writing import settle, writing_engine


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def test_a_base_that_cannot_be_read_holds_back_only_its_own_records(store):
    """The base of one dirty blob cannot be faulted (the source fails for a while): the
    checkpoint folds every other blob and lets the journal go up to that blob's records;
    once the source reads again, the next checkpoint folds it too."""
    data, src, eng, tag, _ops = writing_engine(store, 3)
    src.fail_calls = {1, 2}  # the base fault, and the first checkpoint's fold of it
    want = bytearray(data[:CS])
    want[5:8] = b"abc"

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(10):
                await eng.write_chunk(tag, 0, 5, b"abc")
                await settle(eng)
                for _ in range(50):
                    await eng.write_chunk(tag, 1, 0, b"q" * CS)
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
