"""User blobs (``engine/writes/users.py``), cut into parts (``table.py`` ``USER_PART``): a user
blob written, truncated, folded and remounted at random against a ``bytearray``; the folds of
a growing blob rewrite only its new parts; blobs made before parts (one dirty file) still
read, grow and shrink; unlink and reset leave no part behind; a change of the user blob table
whose state save fails changes nothing (the failure a rule of the file operations)."""

from __future__ import annotations

import errno
import random

import pytest
import trio

from faultfs.engine.writes import USER_PREFIX, part_name, user_key, void_key
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import engine_for
from faultfs.testing.writes_model import UPART, WritesWorld
from faultfs.testing.writing import full_journal, writing_engine


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


P = UPART  # the parts of the model's engines (the mount's are USER_PART, 1 MiB)
NAME = "out.bin"


def _user(world: WritesWorld) -> bytes:
    w = world.engine.writes
    size = w.user_size(world.tag, NAME)
    return bytes(world.run(w.read_user, world.tag, NAME, 0, size + 7))


def _part_files(world: WritesWorld) -> list[str]:
    return sorted(n for n in world.engine.writes.files.names(world.tag.name)
                  if n.startswith(USER_PREFIX))


@pytest.mark.parametrize("seed", range(6))
def test_a_user_blob_in_parts_matches_a_bytearray_through_folds_kills_and_remounts(seed):
    rng = random.Random(seed)
    world = WritesWorld(4 * 4096, 4096)
    try:
        w = world.engine.writes
        world.run(w.create_user, world.tag, NAME)
        model = bytearray()
        for step in range(120):
            op = rng.random()
            w = world.engine.writes
            if op < 0.55:
                off = rng.randrange(0, 5 * P)
                data = rng.randbytes(rng.choice([1, 4096, 128 << 10, P, P + 3, rng.randrange(1, 2 * P)]))
                assert world.run(w.write_user, world.tag, NAME, off, data) == len(data)
                if off > len(model):
                    model.extend(bytes(off - len(model)))
                model[off:off + len(data)] = data
            elif op < 0.75:
                size = rng.choice([0, P, 2 * P - 1, rng.randrange(0, 6 * P)])
                world.run(w.truncate_user, world.tag, NAME, size)
                model = model[:size] + bytearray(max(0, size - len(model)))
            elif op < 0.85:
                world.checkpoint()
            elif op < 0.95:
                world.remount("kill")
            else:
                world.remount("clean")
            w = world.engine.writes
            assert w.user_size(world.tag, NAME) == len(model), f"step {step}"
            if rng.random() < 0.3 or op >= 0.75:
                assert _user(world) == bytes(model), f"step {step}"
            else:  # a random range
                off = rng.randrange(0, len(model) + 10)
                size = rng.randrange(0, 3 * P)
                got = bytes(world.run(w.read_user, world.tag, NAME, off, size))
                assert got == bytes(model[off:off + size]), f"step {step}"
        world.remount("clean")
        assert _user(world) == bytes(model)
        world.run(world.engine.writes.unlink_user, world.tag, NAME)
        world.remount("kill")  # the unlink's record is replayed: its parts stay gone
        assert world.engine.user_id(world.tag, NAME) is None
        world.checkpoint()  # the state without it is saved: its files go
        assert _part_files(world) == [], "unlink leaves no part behind"
    finally:
        world.close()


def test_a_growing_user_blob_folds_only_its_new_parts():
    """An append-only writer (``cp``): each checkpoint rewrites the parts written since the
    last one, not the whole blob (one dirty file was rewritten whole every time)."""
    world = WritesWorld(4096, 4096)
    try:
        w = world.engine.writes
        world.run(w.create_user, world.tag, NAME)
        piece = P // 4
        data = random.Random(1).randbytes(6 * P)
        folds = []
        for step in range(3):  # 2 MiB appended, then a checkpoint
            for off in range(step * 2 * P, (step + 1) * 2 * P, piece):
                world.run(w.write_user, world.tag, NAME, off, data[off:off + piece])
            before = world.engine.stats.counters.get("folds", 0)
            world.checkpoint()
            folds.append(world.engine.stats.counters.get("folds", 0) - before)
        assert folds == [2, 2, 2], "each checkpoint folds the two parts written since the last"
        world.remount("clean")
        assert _user(world) == data
        assert len(_part_files(world)) == 6
    finally:
        world.close()


def test_a_user_blob_made_before_parts_still_reads_grows_and_shrinks():
    """A store written before parts has one dirty file ``u:<id>`` per user blob and no
    ``parted`` entry in its write state: it stays one blob (up to 1 GiB)."""
    world = WritesWorld(4096, 4096)
    try:
        w = world.engine.writes
        world.run(w.create_user, world.tag, NAME)
        uid = w.user_id(world.tag, NAME)
        w.tags[world.tag.id].parted.discard(uid)  # as an older faultfs made it
        world.run(w.states.save, world.tag.id)
        data = random.Random(2).randbytes(P + 5000)
        world.run(w.write_user, world.tag, NAME, 0, data)
        world.remount("clean")
        assert _user(world) == data and _part_files(world) == [f"{USER_PREFIX}{uid}"]
        w = world.engine.writes
        world.run(w.write_user, world.tag, NAME, 3 * P, b"tail")
        world.run(w.truncate_user, world.tag, NAME, 3 * P + 2)
        world.remount("kill")
        want = data + bytes(3 * P - len(data)) + b"ta"
        assert _user(world) == want and _part_files(world) == [f"{USER_PREFIX}{uid}"]
        from faultfs.engine.writes import USER_BLOB_MAX
        from faultfs.errors import FaultfsError

        w = world.engine.writes
        for grow in (lambda: w.write_user(world.tag, NAME, USER_BLOB_MAX, b"x"),
                     lambda: w.truncate_user(world.tag, NAME, USER_BLOB_MAX + 1)):
            with pytest.raises(FaultfsError) as info:  # one dirty file: no longer than a blob
                world.run(grow)
            assert info.value.errno == errno.EFBIG
        assert _user(world) == want
        world.remount("clean")  # folded: nothing in memory, nothing pending
        world.run(world.engine.writes.truncate_user, world.tag, NAME, 4 * P)
        world.remount("clean")  # a size change alone is folded too (it was lost before)
        assert _user(world) == want + bytes(P - 2)
    finally:
        world.close()


def test_a_reset_user_blob_is_empty_and_none_of_its_parts_come_back():
    world = WritesWorld(4096, 4096)
    try:
        w = world.engine.writes
        world.run(w.create_user, world.tag, NAME)
        world.run(w.write_user, world.tag, NAME, 0, b"x" * (3 * P))
        world.checkpoint()
        world.run(w.write_user, world.tag, NAME, 4 * P, b"journal only")
        world.run(w.reset, world.tag, [NAME])
        assert w.user_size(world.tag, NAME) == 0
        world.remount("kill")  # the journal still holds the writes: the void mark hides them
        assert _user(world) == b""
        world.run(world.engine.writes.write_user, world.tag, NAME, 5, b"new")
        world.remount("clean")
        assert _user(world) == b"\0" * 5 + b"new"
    finally:
        world.close()


def test_part_names():
    assert [part_name(7, k) for k in range(3)] == ["u:7", "u:7.1", "u:7.2"]
    assert [user_key(n) for n in ("u:7", "u:7.2", "u:7.0", "u:07", "u:7.", "chunk_1")] == [
        (7, 0), (7, 2), None, None, None, None]
    assert void_key("u:7.5") == "u:7" and void_key("chunk_3") == "chunk_3"


@pytest.mark.parametrize("change", ["create", "unlink", "rename", "exchange"])
def test_a_user_blob_table_change_the_journal_has_no_room_for_changes_nothing(store, change):
    """Creating, unlinking, renaming or exchanging a user blob whose journal record cannot be
    appended (ENOSPC) is refused and changes nothing: not in this mount, not at the tag's
    next state save, not after a remount."""
    _, _, eng, tag, ops = writing_engine(store, 1)
    w = eng.writes
    full = full_journal(ops)

    async def main():
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await w.create_user(tag, "a.txt")
                await w.write_user(tag, "a.txt", 0, b"kept")
                await w.create_user(tag, "x.txt")
                full.on()
                attempt = {"create": lambda: w.create_user(tag, "b.txt"),
                           "unlink": lambda: w.unlink_user(tag, "a.txt"),
                           "rename": lambda: w.rename_user(tag, "a.txt", "b.txt"),
                           "exchange": lambda: w.exchange_users(tag, "a.txt", "x.txt")}[change]
                with pytest.raises(FaultfsError) as err:
                    await attempt()
                assert err.value.errno == errno.ENOSPC
                full.off()
                assert sorted(w.user_names(tag)) == ["a.txt", "x.txt"]
                await w.create_user(tag, "c.txt")
                await w.checkpoint()  # the tag's next state save
                assert sorted(w.user_names(tag)) == ["a.txt", "c.txt", "x.txt"]
                assert bytes(await w.read_user(tag, "a.txt", 0, 10)) == b"kept"
            nursery.cancel_scope.cancel()

    trio.run(main)
    eng.close()  # a kill: the journal is replayed over the saved state
    eng2 = engine_for(store, memory_mb=1, prefetch_mb=0)
    [tag2] = eng2.recover()
    assert sorted(eng2.writes.user_names(tag2)) == ["a.txt", "c.txt", "x.txt"]
    assert bytes(trio.run(eng2.writes.read_user, tag2, "a.txt", 0, 10)) == b"kept"
    eng2.close()


@pytest.mark.parametrize("stop", ["kill", "power"])
def test_user_blob_changes_are_replayed_in_order_with_the_writes_around_them(stop):
    """Create, write, rename over another, exchange, unlink, create again under a used name:
    each a journal record, replayed in order with the writes (no state save between), and
    durable when answered (a power loss keeps them all)."""
    world = WritesWorld(4096, 4096)
    try:
        w = world.engine.writes
        run, tag = world.run, world.tag
        run(w.create_user, tag, "a")
        run(w.write_user, tag, "a", 0, b"first a")
        run(w.create_user, tag, "b")
        run(w.write_user, tag, "b", 0, b"first b")
        run(w.rename_user, tag, "a", "b")  # b is a's bytes; the old b is gone
        run(w.create_user, tag, "c")
        run(w.write_user, tag, "c", 0, b"c")
        run(w.exchange_users, tag, "b", "c")
        run(w.unlink_user, tag, "b")  # (the one that was c)
        run(w.create_user, tag, "b")
        run(w.write_user, tag, "b", 0, b"new b")
        run(w.fsync)
        world.remount(stop, random.Random(1))
        w, tag = world.engine.writes, world.tag
        assert sorted(w.user_names(tag)) == ["b", "c"]
        assert bytes(run(w.read_user, tag, "c", 0, 20)) == b"first a"
        assert bytes(run(w.read_user, tag, "b", 0, 20)) == b"new b"
    finally:
        world.close()
