"""What the tests of the write path (``tests/test_writes_*.py``) share: an engine over a fake
source with its writes' file operations in a test's hands (``FaultyOps``), the failures they
inject (a full journal, slow journal syncs), and what a tag shows after
a kill -9 and after an unmount.

No private attribute of the engine is touched: failures come through the file operations, as
``crashfs.py``'s crashes do, and sources fail as ``fakes.py``'s do.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Awaitable, Callable
from typing import NamedTuple

import trio

from faultfs.engine import Engine, Tag
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, MemorySource, ctx_for, engine_for, make_source, payload
from faultfs.testing.fileops import FaultyOps, Rule, fail
from faultfs.tiers.base import StoreOutcome

JOURNAL = "/journal/w-"  # the journal's segments (``store/journal.py``)


class Writing(NamedTuple):
    """A source of ``chunks`` chunks, an engine over it and its tag, and the file operations
    of its writes."""

    data: bytes
    src: MemorySource
    eng: Engine
    tag: Tag
    ops: FaultyOps


def writing_engine(store: BlobStore, chunks: int, *, gated: bool = False, **config) -> Writing:
    """``Writing`` for the write tests (``gated``: every source read waits for ``src.gate``)."""
    data = payload(CS * chunks)
    src = make_source(data)
    if gated:
        src.gate = threading.Event()
    ops = FaultyOps()
    config.setdefault("memory_mb", 1)
    config.setdefault("prefetch_mb", 0)
    eng = engine_for(store, writes_ops=ops, **config)
    return Writing(data, src, eng, eng.register(ctx_for()), ops)


async def settle(eng: Engine) -> None:
    """Wait until background faults, prefetches and store writes are done."""
    with trio.fail_after(10):
        while eng.busy:  # noqa: ASYNC110 - test polls
            await trio.sleep(0.005)


def full_journal(ops: FaultyOps) -> Rule:
    """The store has no room for journal records (ENOSPC: nothing is appended) while the rule
    is on; ``rule.on(after=n)`` lets ``n`` more through first. Off to begin with."""
    return ops.when("pwrite", JOURNAL, fail(errno.ENOSPC)).off()


def slow_journal_syncs(eng: Engine, ops: FaultyOps) -> list[int]:
    """Make the journal's syncs slow (so fsyncs queue behind one) and note, for each, the
    journal's next seq when it began (the tests write one segment: one fsync a sync)."""
    began: list[int] = []
    journal = eng.writes.journal

    def slow(path: str) -> None:
        began.append(journal.next_seq)
        time.sleep(0.05)

    ops.when("fsync", JOURNAL, slow)
    return began


def put_through(eng: Engine, before: Callable[[tuple[int, int]], Awaitable[StoreOutcome | None]]
                ) -> None:
    """Run ``before(key)`` ahead of each store write of a faulted chunk; an outcome it returns
    is the store write's (it is skipped), None lets it go on."""
    real = eng.tiers.local.put

    async def put(key, data):
        outcome = await before(key)
        return outcome if outcome is not None else await real(key, data)

    eng.tiers.local.put = put  # type: ignore[method-assign]


def recovered_over_a_new_version(store: BlobStore, data: bytes) -> tuple[Engine, Tag, bytes]:
    """The source changed (its bytes reversed, a new version token) and the store remounted
    over it: (the engine, its recovered tag, the new bytes)."""
    new = bytes(reversed(data))
    src = make_source(new)
    src.token = "v2"
    eng = engine_for(store, memory_mb=1, prefetch_mb=0)
    [tag] = eng.recover()
    return eng, tag, new


async def tag_as_shown(eng: Engine, tag: Tag) -> tuple[bytes, int, dict[str, bytes], int]:
    """What a tag shows: its view (bytes and size), its user blobs (names and bytes), its
    mtime."""
    size = eng.view_size(tag)
    users = {name: bytes(await eng.read_user(tag, name, 0, 1 << 20))
             for name in eng.user_names(tag)}
    return bytes(await eng.read_view(tag, 0, size)), size, users, eng.written_ns(tag)


def shown_after_a_kill_and_after_an_unmount(store: BlobStore, eng: Engine) -> list[tuple]:
    """What the engine's one tag shows at a remount after a kill -9 (the journal replayed),
    then at one after a clean unmount of that."""
    eng.writes.journal.sync()
    eng.close()  # no close_writes: as after a kill -9
    shown = []
    for _ in range(2):
        again = engine_for(store, memory_mb=1, prefetch_mb=0)
        again.writes.user_part = eng.writes.user_part
        [tag] = again.recover()

        async def show(e: Engine = again, t: Tag = tag) -> tuple:
            got = await tag_as_shown(e, t)
            await e.close_writes()
            return got

        shown.append(trio.run(show))
        again.close()
    return shown


async def written_every_way(eng: Engine, tag: Tag) -> None:
    """Writes of every kind a reset drops: a partial write over the source (chunk 0), one
    over a folded file (chunk 1), a whole chunk (chunk 2), the view grown (chunk 4), and a
    user blob "f" of two parts."""
    await eng.write_chunk(tag, 1, 7, b"folded")
    await eng.writes.checkpoint()
    await eng.write_chunk(tag, 1, 100, b"over the fold")
    await eng.write_chunk(tag, 0, 5, b"partial")
    await eng.write_chunk(tag, 2, 0, bytes(reversed(payload(CS))))
    await eng.write_view(tag, 4 * CS + 50, b"g" * 50)
    await eng.create_user(tag, "f")
    await eng.write_user(tag, "f", 10, b"u" * (eng.writes.user_part + 20))
    await settle(eng)


RESET_ALL = ["chunk_0", "chunk_1", "chunk_2", "chunk_4", "f"]
