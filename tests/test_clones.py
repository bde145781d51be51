"""Clones without a mount (DESIGN §12): a clone is its tag at one instant, also while the tag
is written — every change answered before the clone began is in it, and no change is in it
without every change answered before that one.

The clone is paused inside its snapshot (between two folds) by wrapping ``Writes.fold``, and
writes are made while it waits: which of them the clone holds is then checked, never timed.
"""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import trio
import trio.lowlevel
import trio.testing

from faultfs.engine.changes import TagChanges
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.store.dirty import STATE
from faultfs.store.fileops import OsFileOps
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload
from faultfs.testing.fileops import FaultyOps
from faultfs.testing.stamps import RECORD, Log, check, seen_chunks, seen_user, stamp, stamp_seq
from faultfs.testing.writing import JOURNAL


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def _engine(store, chunks=4):
    make_source(payload(CS * chunks))
    eng = engine_for(store, memory_mb=1, prefetch_mb=0)
    return eng, eng.register(ctx_for())


def test_a_hold_waits_for_the_changes_under_way_and_lets_their_own_pieces_in():
    """``TagChanges`` alone: a hold begun while a change of its tag is under way waits for
    it; that change's own inner change (a page write's slice) goes in at once, another
    task's change waits for the hold to end; a change of another tag never waits; a hold
    cancelled while it waits lets the changes it held back go."""
    changes = TagChanges()
    events: list[str] = []

    async def change(tag_id, name, inner=None):
        async with changes.change(tag_id):
            events.append(f"{name} in")
            if inner is not None:
                await inner.wait()
                async with changes.change(tag_id):
                    events.append(f"{name} inner")
        events.append(f"{name} out")

    async def hold(name):
        async with changes.hold(1):
            events.append(f"{name} snapshot")

    async def cancellable(fn, *args, task_status=trio.TASK_STATUS_IGNORED):
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await fn(*args)

    async def main():
        with trio.fail_after(5):
            go = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(change, 1, "page", go)
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(hold, "clone")
                await trio.testing.wait_all_tasks_blocked()
                assert changes.held(1) and changes.under_way(1) == 1
                nursery.start_soon(change, 1, "write")
                nursery.start_soon(change, 2, "other")
                await trio.testing.wait_all_tasks_blocked()
                go.set()
            assert events == ["page in", "other in", "other out", "page inner", "page out",
                              "clone snapshot", "write in", "write out"]
            events.clear()
            go = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(change, 1, "slow", go)
                await trio.testing.wait_all_tasks_blocked()
                scope = await nursery.start(cancellable, hold, "cancelled")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(change, 1, "late")
                await trio.testing.wait_all_tasks_blocked()
                assert changes.held(1) and "late in" not in events
                scope.cancel()
                await trio.testing.wait_all_tasks_blocked()
                assert not changes.held(1) and "late in" in events
                go.set()
            assert "cancelled snapshot" not in events and changes.under_way(1) == 0

    trio.run(main)


class _PausedFolds:
    """``Checkpoints.fold`` wrapped: from fold call number ``at`` (1-based) on, each fold sets
    ``paused`` and waits for ``go`` first."""

    def __init__(self, eng, at: int) -> None:
        self.at, self.calls = at, 0
        self.paused, self.go = trio.Event(), trio.Event()
        self._fold = eng.writes.checkpoints.fold
        eng.writes.checkpoints.fold = self.fold

    async def fold(self, blob, **kw):
        self.calls += 1
        if self.calls >= self.at:
            self.paused.set()
            await self.go.wait()
        await self._fold(blob, **kw)


async def _quiet(eng) -> None:
    """Until every task waits and no call runs on the I/O pool: a writer started before is
    then answered, or waits for something that only another task's progress can end."""
    while True:
        await trio.testing.wait_all_tasks_blocked()
        if not eng.pool.limiter.borrowed_tokens:
            return
        await trio.sleep(0.002)


async def _bytes(eng, tag, index, off, n) -> bytes:
    return bytes(await eng.read_blob(tag, index, off, n))


async def _user(eng, tag, name) -> bytes:
    w = eng.writes
    return bytes(await w.read_user(tag, name, 0, w.user_size(tag, name)))


# the later change of each case: what it does to the tag, and whether a clone holds it. Its
# blob (or the table it changes) is taken by the clone after chunk_0's, as folds go today
LATER = {
    "chunk": (lambda e, t: e.writes.write_chunk(t, 1, 40, b"second!!"),
              lambda e, c: _bytes(e, c, 1, 40, 8), b"second!!"),
    "view grown": (lambda e, t: e.writes.write_view(t, 4 * CS, b"second!!"),
                   lambda e, c: _now(e.writes.view_size(c)), 4 * CS + 8),
    "view shrunk": (lambda e, t: e.writes.truncate_view(t, 3 * CS),
                    lambda e, c: _now(e.writes.view_size(c)), 3 * CS),
    "page": (lambda e, t: e.pages.write_page(t, 0, CS + 40, b"second!!"),
             lambda e, c: _bytes(e, c, 1, 40, 8), b"second!!"),
    "user write": (lambda e, t: e.writes.write_user(t, "notes", 6, b"second!!"),
                   lambda e, c: _user(e, c, "notes"), b"notes:second!!"),
    "user truncate": (lambda e, t: e.writes.truncate_user(t, "notes", 2),
                      lambda e, c: _user(e, c, "notes"), b"no"),
    "create": (lambda e, t: e.writes.create_user(t, "late"),
               lambda e, c: _now("late" in e.writes.user_names(c)), True),
    "unlink": (lambda e, t: e.writes.unlink_user(t, "notes"),
               lambda e, c: _now("notes" not in e.writes.user_names(c)), True),
    "rename": (lambda e, t: e.writes.rename_user(t, "notes", "renamed"),
               lambda e, c: _now("renamed" in e.writes.user_names(c)), True),
}


async def _now(value):
    return value


@pytest.mark.parametrize("later", sorted(LATER))
def test_a_clone_never_holds_a_change_without_one_answered_before_it(store, later):
    """A writer is answered for ``first`` (chunk_0), then for a ``later`` change, while the
    clone is inside its snapshot: the clone may hold both, neither or only ``first`` — never
    the later change without ``first``. What was answered before the clone began is in it."""
    eng, tag = _engine(store)
    eng.write_identity_pagemap(tag, 2 * CS)
    do, seen, value = LATER[later]
    w = eng.writes
    answered: list[str] = []

    async def writer(done):
        await w.write_chunk(tag, 0, 16, b"first!!!")
        answered.append("first")
        await do(eng, tag)
        answered.append("later")
        done.set()

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            await w.write_chunk(tag, 1, 0, b"before-1")
            await w.create_user(tag, "notes")
            await w.write_user(tag, "notes", 0, b"notes:")
            pause = _PausedFolds(eng, at=2)  # chunk_0 folded, the rest not yet
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(eng.clone_tag, tag, "snap")
                await pause.paused.wait()
                nursery.start_soon(writer, done)
                await _quiet(eng)
                pause.go.set()
            assert answered == ["first", "later"]
            snap = eng.tags["snap"]
            assert await _bytes(eng, snap, 0, 0, 8) == b"before-0"
            assert await _bytes(eng, snap, 1, 0, 8) == b"before-1"
            first = await _bytes(eng, snap, 0, 16, 8) == b"first!!!"
            if await seen(eng, snap) == value:
                assert first, f"the clone holds the {later} change without the write " \
                              "answered before it"
            # the parent has both, and the clone is a tag of its own
            assert await _bytes(eng, tag, 0, 16, 8) == b"first!!!"
            assert await seen(eng, tag) == value

    trio.run(main)
    eng.close()


class _Writer:
    """Changes made one after another in a task of their own, noting each answered."""

    def __init__(self, nursery, *changes) -> None:
        self.answered: list[int] = []
        self.done = trio.Event()
        nursery.start_soon(self._run, changes)

    async def _run(self, changes) -> None:
        for k, change in enumerate(changes):
            await change()
            self.answered.append(k)
        self.done.set()


def test_changes_started_while_the_clone_holds_the_tag_wait_for_its_snapshot(store):
    """Inside the clone's hold (its second round of folds) a write, a user blob's creation
    and a reset wait; once the clone has its snapshot they go on, and the clone holds none
    of them."""
    eng, tag = _engine(store)
    w = eng.writes

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            await w.write_chunk(tag, 1, 0, b"before-1")
            pause = _PausedFolds(eng, at=3)  # the hold's first fold (two blobs before it)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(eng.clone_tag, tag, "snap")
                await pause.paused.wait()
                assert w.changes.held(tag.id)
                writer = _Writer(nursery, lambda: w.write_chunk(tag, 0, 16, b"first!!!"),
                                 lambda: w.create_user(tag, "late"),
                                 lambda: w.reset(tag, ["chunk_1"]))
                await _quiet(eng)
                assert writer.answered == [], "a change of a held tag waits"
                pause.go.set()
            assert writer.answered == [0, 1, 2]
            snap = eng.tags["snap"]
            assert await _bytes(eng, snap, 0, 0, 24) == b"before-0" + payload(CS)[8:24]
            assert await _bytes(eng, snap, 1, 0, 8) == b"before-1"
            assert eng.writes.user_names(snap) == []
            assert await _bytes(eng, tag, 1, 0, 8) == payload(2 * CS)[CS:CS + 8]
            assert not w.changes.held(tag.id)

    trio.run(main)
    eng.close()


def test_a_change_under_way_when_the_clone_begins_is_in_it_whole(store):
    """A user blob's creation is under way (its journal sync held on the I/O pool) when the
    clone begins: the clone waits for it and holds it; a write started once the clone holds
    the tag waits, and is not in the clone."""
    make_source(payload(CS * 4))
    ops = FaultyOps()
    eng = engine_for(store, memory_mb=1, prefetch_mb=0, writes_ops=ops)
    tag = eng.register(ctx_for())
    w = eng.writes
    saving, release = threading.Event(), threading.Event()

    def slow_sync(path: str) -> None:  # (the journal's first sync: the creation's)
        saving.set()
        release.wait(10)

    ops.when("fsync", JOURNAL, slow_sync, times=1)

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            async with trio.open_nursery() as nursery:
                creator = _Writer(nursery, lambda: w.create_user(tag, "late"))
                while not saving.is_set():  # noqa: ASYNC110 - the sync runs on a thread
                    await trio.sleep(0.001)
                nursery.start_soon(eng.clone_tag, tag, "snap")
                while not w.changes.held(tag.id):  # noqa: ASYNC110 - its folds run first
                    await trio.sleep(0.001)
                writer = _Writer(nursery, lambda: w.write_chunk(tag, 1, 0, b"after!!!"))
                await trio.testing.wait_all_tasks_blocked()
                assert not creator.answered and not writer.answered
                assert "snap" not in eng.tags, "the clone waits for the change under way"
                release.set()
            assert creator.answered == [0] and writer.answered == [0]
            snap = eng.tags["snap"]
            assert eng.writes.user_names(snap) == ["late"]
            assert await _bytes(eng, snap, 1, 0, 8) == payload(2 * CS)[CS:CS + 8]
            assert await _bytes(eng, tag, 1, 0, 8) == b"after!!!"

    trio.run(main)
    eng.close()


def test_a_clones_writes_are_read_on_the_pool_and_put_in_the_table_on_the_trio_thread(store):
    """The write table is the trio thread's: a clone's dirty files are read on the I/O pool
    and their blobs added here (added on a pool thread, they raced another clone's walk of
    the table: "dictionary changed size during iteration", seen once in a CI run); so are
    the tag tables, which the mount's lookups and listings walk: the clone's registry entry
    and state are written on the pool, the tag added here."""
    make_source(payload(CS * 4))
    eng = engine_for(store, memory_mb=1, prefetch_mb=0)
    tag = eng.register(ctx_for())
    w = eng.writes
    threads: list[bool] = []
    add = w.table.add

    def add_here(blob):
        threads.append(threading.current_thread() is threading.main_thread())
        return add(blob)

    w.table.add = add_here
    tables: list[bool] = []  # the tag tables, the registry's entries too (they raced alike)

    class Watched(dict):
        def __setitem__(self, key, value):
            tables.append(threading.current_thread() is threading.main_thread())
            super().__setitem__(key, value)

    for name in ("by_name", "by_id", "registry"):
        setattr(eng._tags, name, Watched(getattr(eng._tags, name)))

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            await w.write_chunk(tag, 2, 0, b"before-2")
            threads.clear()
            await eng.clone_tag(tag, "snap")
        assert len(threads) >= 2 and all(threads), threads
        assert len(tables) == 3 and all(tables), tables
        assert await _bytes(eng, eng.tags["snap"], 2, 0, 8) == b"before-2"

    trio.run(main)
    eng.close()


def _remount(store, eng):
    """A new engine over the store as ``eng`` left it (a kill -9: no unmount); its tags."""
    eng.close()
    eng2 = engine_for(store, memory_mb=1, prefetch_mb=0)
    return eng2, {t.name: t for t in eng2.recover()}


def test_a_blob_reset_while_a_clone_folds_is_not_written_back(store):
    """A reset drops chunk_1 while the clone's folds (before it holds the tag) are paused
    with chunk_1 still in their list, and the journal moves on: the fold of the dropped
    blob writes nothing, so no file of it outlives the reset — the parent reads the
    source's bytes there, also after a remount, and so does the clone."""
    eng, tag = _engine(store)
    w = eng.writes
    source = payload(2 * CS)[CS:CS + 8]

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            await w.write_chunk(tag, 1, 0, b"before-1")
            pause = _PausedFolds(eng, at=1)  # before the first fold of the clone
            async with trio.open_nursery() as nursery:
                nursery.start_soon(eng.clone_tag, tag, "snap")
                await pause.paused.wait()
                assert await w.reset(tag, ["chunk_1"]) == 1
                await w.write_chunk(tag, 2, 0, b"later!!!")  # the journal moves on
                pause.go.set()
            assert await _bytes(eng, tag, 1, 0, 8) == source
            assert await _bytes(eng, eng.tags["snap"], 1, 0, 8) == source

    trio.run(main)
    eng2, tags = _remount(store, eng)

    async def after():
        assert await _bytes(eng2, tags["t"], 1, 0, 8) == source
        assert await _bytes(eng2, tags["t"], 2, 0, 8) == b"later!!!"
        assert await _bytes(eng2, tags["snap"], 1, 0, 8) == source

    trio.run(after)
    eng2.close()


def test_a_clone_never_brings_back_a_file_a_reset_left_behind(store):
    """chunk_1's dirty file outlives the reset of chunk_1 (the daemon was killed before the
    reset deleted it; a mount skips it by the reset's mark): a clone of the tag reads the
    source's bytes there too, as its parent does, also after a remount."""
    eng, tag = _engine(store)
    w = eng.writes
    source = payload(2 * CS)[CS:CS + 8]

    async def main():
        await w.write_chunk(tag, 1, 0, b"before-1")
        await w.checkpoint()  # chunk_1 has a dirty file
        w.files.delete = lambda tag_name, name: None  # killed before the reset deleted it
        assert await w.reset(tag, ["chunk_1"]) == 1

    trio.run(main)
    eng2, tags = _remount(store, eng)

    async def clone():
        assert await _bytes(eng2, tags["t"], 1, 0, 8) == source
        snap = await eng2.clone_tag(tags["t"], "snap")
        assert await _bytes(eng2, snap, 1, 0, 8) == source

    trio.run(clone)
    eng3, tags = _remount(store, eng2)

    async def after():
        assert await _bytes(eng3, tags["snap"], 1, 0, 8) == source

    trio.run(after)
    eng3.close()


class _PausedStateSave(OsFileOps):
    """File operations whose first rename onto tag ``t``'s write state, once ``armed``,
    waits (on its I/O thread) for ``go``: the save's temporary file is in the directory."""

    def __init__(self) -> None:
        super().__init__(links=False, what="dirty file")  # as the store's own
        self.armed = False
        self.renaming, self.go = threading.Event(), threading.Event()

    def rename(self, src: str, dst: str) -> None:
        if self.armed and dst == os.path.join(os.path.dirname(dst), STATE) \
                and os.path.basename(os.path.dirname(dst)) == "t-t":
            self.armed = False
            self.renaming.set()
            self.go.wait(10)
        super().rename(src, dst)


def test_a_clone_leaves_the_files_a_checkpoint_is_writing_alone(store):
    """A checkpoint is saving the tag's write state (its temporary file written, not yet
    renamed) while a clone links the tag's files: the clone leaves that file alone, so the
    checkpoint's save, and the checkpoint, succeed."""
    make_source(payload(CS * 4))
    ops = _PausedStateSave()
    eng = engine_for(store, memory_mb=1, prefetch_mb=0, writes_ops=ops)
    tag = eng.register(ctx_for())
    w = eng.writes

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            ops.armed = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(w.checkpoint)
                while not ops.renaming.is_set():  # noqa: ASYNC110 - on an I/O thread
                    await trio.sleep(0.001)
                snap = await eng.clone_tag(tag, "snap")
                ops.go.set()
            assert eng.stats.counters["checkpoints"] == 1, "the checkpoint failed"
            assert await _bytes(eng, snap, 0, 0, 8) == b"before-0"

    trio.run(main)
    eng.close()


def test_a_second_clone_of_a_name_being_made_is_refused_at_once(store):
    """While a clone ``snap`` is being made, another clone named ``snap`` (of any tag) is
    refused with EEXIST at once: it never removes or relinks the first one's files."""
    eng, tag = _engine(store)
    w = eng.writes

    async def main():
        with trio.fail_after(10):
            await w.write_chunk(tag, 0, 0, b"before-0")
            pause = _PausedFolds(eng, at=1)
            refused: list[int] = []

            async def second():
                try:
                    await eng.clone_tag(tag, "snap")
                except FaultfsError as exc:
                    refused.append(exc.errno)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(eng.clone_tag, tag, "snap")
                await pause.paused.wait()
                nursery.start_soon(second)
                await _quiet(eng)
                assert refused == [errno.EEXIST]
                pause.go.set()
            assert await _bytes(eng, eng.tags["snap"], 0, 0, 8) == b"before-0"

    trio.run(main)
    eng.close()


def test_clones_beside_writers_checkpoints_resets_and_each_other_are_each_an_instant(store):
    """Two stamping writers (``faultfs.testing.stamps``: the chunks in turn, a user blob
    appended), checkpoints, resets of a chunk no writer stamps, and two clones of the tag at
    a time, again and again: nothing waits forever, and every clone is the tag at one
    instant by the writers' logs."""
    eng, tag = _engine(store, chunks=8)
    w = eng.writes
    w.user_part = 4 * RECORD  # (a few stamps cross a part)
    logs = {"chunks": Log([], []), "user": Log([], [])}
    clones: list[tuple[str, int]] = []
    cloning = [2]

    async def stamping(kind: str) -> None:
        log = logs[kind]
        seq = 0
        while cloning[0]:
            seq += 1
            log.started.append(time.monotonic_ns())
            if kind == "chunks":
                await w.write_chunk(tag, (seq - 1) % 6, 0, stamp(seq))
            else:
                await w.write_user(tag, "stamps", (seq - 1) * RECORD, stamp(seq))
            log.answered.append(time.monotonic_ns())
            await trio.lowlevel.checkpoint()

    async def clone(k: int) -> None:
        for n in range(4):
            await trio.sleep(0.002)
            name = f"snap{k}-{n}"
            began = time.monotonic_ns()
            await eng.clone_tag(tag, name)
            clones.append((name, began))
        cloning[0] -= 1

    async def disturbing() -> None:
        while cloning[0]:
            await w.write_chunk(tag, 7, 5, b"other")
            await w.checkpoint()
            await w.reset(tag, ["chunk_7"])
            await trio.sleep(0.001)

    async def main():
        await w.create_user(tag, "stamps")
        with trio.fail_after(150):  # a hang guard: 20 s quiet, 79 s once at load 17
            async with trio.open_nursery() as nursery:
                eng.attach(nursery)
                async with trio.open_nursery() as work:
                    work.start_soon(stamping, "chunks")
                    work.start_soon(stamping, "user")
                    work.start_soon(clone, 0)
                    work.start_soon(clone, 1)
                    work.start_soon(disturbing)
                nursery.cancel_scope.cancel()
        assert all(len(log.started) > 10 for log in logs.values())
        problems = {}
        for name, began in clones:
            snap = eng.tags[name]
            chunks = [stamp_seq(await _bytes(eng, snap, i, 0, 16)) for i in range(6)]
            found = check({"chunks": seen_chunks(chunks),
                           "user": seen_user(await _user(eng, snap, "stamps"))}, logs, began)
            if found:
                problems[name] = found
        assert not problems

    trio.run(main)
    eng.close()
