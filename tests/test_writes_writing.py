"""Writes and truncates of chunks, the view and user blobs (``engine/writes/writing.py`` and
``blobwrite.py``): a write refused for room partway returns what landed; a refused write
leaves nothing behind (not dirty, not pinned, never folded into a copy of the source's
bytes); a write across the growth limit writes what fits. A full store is a rule of the file
operations (``FaultyOps``: the journal's appends fail with ENOSPC)."""

from __future__ import annotations

import errno

import pytest
import trio

from faultfs.engine.writes import MAX_GROWN
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS
from faultfs.testing.writing import (
    full_journal,
    recovered_over_a_new_version,
    settle,
    writing_engine,
)


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


@pytest.mark.parametrize("name", ["view", "user"])
def test_a_write_refused_for_room_partway_returns_the_bytes_that_landed(store, name):
    """A write across chunks (or user blob parts) whose second piece the store has no room
    for (ENOSPC) returns a short count, as a full disk's write does: the first piece is
    written and the file's size is what landed, never ENOSPC over bytes that did land; a
    write refused at its first piece is refused whole."""
    _, _, eng, tag, ops = writing_engine(store, 4)
    room = full_journal(ops)
    eng.writes.user_part = CS

    async def write(off, payload):
        if name == "view":
            return await eng.write_view(tag, off, payload)
        return await eng.write_user(tag, "notes", off, payload)

    async def size():
        if name == "view":
            return eng.view_size(tag)
        return eng.user_size(tag, "notes")

    async def read(off, n):
        if name == "view":
            return bytes(await eng.read_view(tag, off, n))
        return bytes(await eng.read_user(tag, "notes", off, n))

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                if name == "user":
                    await eng.create_user(tag, "notes")
                start = 4 * CS - 100 if name == "view" else CS - 100
                room.on(after=1)  # the first piece's record, then no room
                assert await write(start, b"y" * 300) == 100
                room.off()
                assert await size() == start + 100
                assert await read(start, 100) == b"y" * 100
                room.on()
                with pytest.raises(FaultfsError) as err:
                    await write(start + 100, b"z" * 50)
                assert err.value.errno == errno.ENOSPC
                room.off()
                assert await size() == start + 100
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()


@pytest.mark.parametrize("size", ["partial", "whole"])
def test_a_refused_write_leaves_no_dirty_blob_behind(store, size):
    """A write the store has no room for (ENOSPC) changed nothing: the chunk is not dirty,
    a read does not pin it again, a checkpoint writes no dirty copy of the source's bytes,
    and after a remount over a new version of the source the chunk reads the new version
    (not the old one frozen in a dirty file); nor does the tag count as written."""
    data, _, eng, tag, ops = writing_engine(store, 2)
    room = full_journal(ops)
    key = (tag.id, 0)
    written = b"x" * 10 if size == "partial" else b"x" * CS

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                await settle(eng)
                await eng.write_chunk(tag, 1, 0, b"w" * 10)  # the journal is not empty
                room.on()
                with pytest.raises(FaultfsError) as err:
                    await eng.write_chunk(tag, 0, 0, written)
                assert err.value.errno == errno.ENOSPC
                room.off()
                await settle(eng)
                assert not eng.writes.is_dirty(tag, 0)
                assert eng.writes.dirty_summary(tag)[0] == 1, "chunk_1 only"
                assert await eng.read_blob(tag, 0, 0, CS) == data[:CS]
                await settle(eng)
                assert not eng.tiers.local.pinned(key), "a read pins no chunk nobody wrote"
                await eng.writes.checkpoint()
                assert "chunk_0" not in eng.writes.files.names(tag.name)
                await eng.close_writes()
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()
    eng2, tag2, new = recovered_over_a_new_version(store, data)
    assert trio.run(eng2.read_blob, tag2, 0, 0, CS) == new[:CS], "never the old version"
    eng2.close()

@pytest.mark.parametrize("name", ["view", "user"])
def test_a_write_across_the_growth_limit_writes_what_fits(store, name):
    """Like a file size limit: a write that starts below 16 TiB and ends past it writes the
    bytes up to the limit and returns that short count (one FUSE request can carry a whole
    `dd bs=1M` block, not only the page the kernel splits off); a write at the limit is
    EFBIG and changes nothing."""
    _, _, eng, tag, _ops = writing_engine(store, 2)
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

