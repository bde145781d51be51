"""Clones read their ancestor's staged blobs (DESIGN §12: a clone's blob faults from its
parent tag as it was at clone time): a clean chunk of a clone is the blob the tag owning the
source staged — no source read, no second copy — also after a remount with the source gone,
for a clone of a clone, and while either side writes. gc and fsck keep those blobs while a
registered clone reads them.

Engine tests use in-memory sources (``faultfs.testing.fakes``); the last test mounts.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading

import pytest
import trio
from conftest import run_faultfs

from faultfs.core.context import REGISTRY_TAG
from faultfs.errors import FaultfsError
from faultfs.store.blobstore import BlobStore
from faultfs.store.fsck import ORPHANED, StoreWalk
from faultfs.store.gc import gc
from faultfs.testing.fakes import CS, MemoryAssimilator, ctx_for, engine_for, make_source, payload

KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def store(tmp_path):
    return BlobStore(str(tmp_path / "store"))


def chunks(store: BlobStore, tag: str) -> list[str]:
    """The chunk blobs the store holds for ``tag``."""
    return sorted(n for n in store.list_blobs(tag) if n.startswith("chunk_"))


def test_a_clone_and_a_clone_of_it_read_the_parents_staged_chunks_with_no_source_read(store):
    data = payload(CS * 3 + 5)
    src = make_source(data)
    eng = engine_for(store, prefetch_mb=0)
    tag = eng.register(ctx_for())
    c = eng.stats.counters

    async def main():
        assert await eng.read_view(tag, 0, len(data)) == data  # staged whole
        clone = await eng.clone_tag(tag, "c")
        grand = await eng.clone_tag(clone, "g")
        eng.tiers.memory.forget_tag(tag.id)  # the local tier's copies, not memory's
        hits = c["hits"]
        for t in (clone, grand):
            assert await eng.read_view(t, 0, len(data)) == data
            for i in range(4):
                assert await eng.read_blob(t, i, 0, CS) == await eng.read_blob(tag, i, 0, CS)
        assert c["hits"] - hits == 2 * (4 + 4) + 4 * 2, "every read of theirs is a hit"
        return clone, grand

    clone, grand = trio.run(main)
    assert src.reads == 4 and c["faults"] == 4 and c["stored"] == 4
    assert chunks(store, "t") == [f"chunk_{i}" for i in range(4)]
    assert chunks(store, "c") == chunks(store, "g") == [], "no second copy"
    assert clone.clean is tag and grand.clean is tag
    assert eng.staged_count(clone) == eng.staged_count(grand) == 4
    assert trio.run(eng.snapshot)["tags"]["g"]["staged_blobs"] == 4


def test_a_clones_miss_is_faulted_once_into_the_parent_and_joins_the_parents_fault(store):
    data = payload(CS * 4)
    src = make_source(data)
    eng = engine_for(store, prefetch_mb=0)
    tag = eng.register(ctx_for())
    src.gate = threading.Event()
    got = {}

    async def main():
        clone = await eng.clone_tag(tag, "c")
        grand = await eng.clone_tag(clone, "g")

        async def reader(t):
            got[t.name] = bytes(await eng.read_blob(t, 2, 0, CS))

        async with trio.open_nursery() as nursery:
            for t in (grand, tag, clone):
                nursery.start_soon(reader, t)
            await trio.sleep(0.1)
            src.gate.set()
        src.gate = None
        assert await eng.read_blob(grand, 1, 0, CS) == data[CS:2 * CS]  # a miss of the clone
        assert await eng.read_blob(tag, 1, 0, CS) == data[CS:2 * CS]  # ... the parent's hit

    trio.run(main)
    assert got == {n: data[2 * CS:3 * CS] for n in ("t", "c", "g")}
    assert src.reads == 2, "one source read per chunk, whichever tag faulted it"
    assert eng.stats.counters["single_flight_joins"] == 2
    assert chunks(store, "t") == ["chunk_1", "chunk_2"]
    assert chunks(store, "c") == chunks(store, "g") == []


def test_after_a_remount_with_the_source_gone_clones_read_every_staged_byte(store):
    """The reproduction at the engine: the parent staged whole, cloned twice, the source gone
    at the remount — the clones read every byte (before, EIO: they faulted their own)."""
    data = payload(CS * 3 + 5)
    make_source(data)
    eng = engine_for(store, prefetch_mb=0)
    tag = eng.register(ctx_for())
    eng.open_writes()

    async def stage_and_clone():
        await eng.read_view(tag, 0, len(data))
        grand = await eng.clone_tag(await eng.clone_tag(tag, "c"), "g")
        await eng.writes.write_chunk(tag, 0, 10, b"parent")  # the parent written after
        await eng.writes.write_chunk(grand, 1, 20, b"grand")
        await eng.close_writes()

    trio.run(stage_and_clone)
    eng.close()
    del MemoryAssimilator.sources["mem://x"]  # the source is gone
    eng2 = engine_for(store, prefetch_mb=0)
    tags = {t.name: t for t in eng2.recover()}
    assert all(t.source is None for t in tags.values())
    parent = bytearray(data)
    parent[10:16] = b"parent"
    grand = bytearray(data)
    grand[CS + 20:CS + 25] = b"grand"

    async def views():
        return {n: bytes(await eng2.read_view(t, 0, len(data))) for n, t in tags.items()}

    assert trio.run(views) == {"t": parent, "c": data, "g": grand}
    assert eng2.stats.counters["fault_errors"] == 0
    assert tags["c"].clean is tags["t"] and tags["g"].clean is tags["t"]
    eng2.close()


def test_a_chunk_a_parent_and_its_clone_wrote_over_is_kept_until_neither_lies_over_it(store):
    """A partial write pins the clean chunk beneath it (never evicted): a clone's write pins
    its ancestor's blob, so it stays while either side's writes lie over it, and becomes
    evictable again once neither does (a reset, a fold or a forget)."""
    make_source(payload(CS * 8))
    eng = engine_for(store, prefetch_mb=0, memory_mb=1, cache_size=2 * (CS + 4096))
    tag = eng.register(ctx_for())

    async def fill(first):  # three reads: they evict the least recently used clean blobs
        for i in range(first, first + 3):
            await eng.read_blob(tag, i, 0, 1)

    async def main():
        clone = await eng.clone_tag(tag, "c")
        await eng.writes.write_chunk(clone, 1, 5, b"c")
        await eng.writes.write_chunk(tag, 1, 7, b"p")
        assert chunks(store, "c") == []
        assert await eng.writes.reset(tag, ["chunk_1"]) == 1  # the parent's lets go
        await fill(2)
        assert eng.is_staged(tag, 1), "the clone's write still lies over it"
        await eng.forget_tag(clone, discard_writes=True)
        await fill(5)
        assert not eng.is_staged(tag, 1), "evictable again"

    trio.run(main)


def test_a_clones_write_over_a_base_the_source_changed_under_is_damaged_as_the_parents(store):
    """The clone's base fault is its ancestor's: when it finds the source changed under the
    mount, the clone's written blob is damaged (EIO naming why), never its write laid over
    the new version — as for the parent's own."""
    data = payload(CS * 2)
    src = make_source(data)
    eng = engine_for(store, memory_mb=1, prefetch_mb=0)
    tag = eng.register(ctx_for())
    src.gate = threading.Event()

    async def main():
        clone = await eng.clone_tag(tag, "c")
        async with trio.open_nursery() as nursery:
            eng.attach(nursery)
            with trio.fail_after(5):
                await eng.writes.write_chunk(clone, 1, 9, b"lost base")
                src.changed = "rewritten in place"
                src.gate.set()
                while eng.busy:  # noqa: ASYNC110 - test polls
                    await trio.sleep(0.005)
                with pytest.raises(FaultfsError, match="source changed") as err:
                    await eng.read_blob(clone, 1, 0, CS)
                assert err.value.errno == errno.EIO
                assert "changed under the mount" in clone.changed_under_mount
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_parent_is_not_forgotten_while_a_clone_reads_its_blobs(store):
    make_source(payload(CS * 2))
    eng = engine_for(store, prefetch_mb=0)
    tag = eng.register(ctx_for())

    async def main():
        await eng.read_view(tag, 0, 2 * CS)
        clone = await eng.clone_tag(tag, "c")
        eng.writes.tags[clone.id].ancestors = ()  # as a clone whose write state was lost
        with pytest.raises(FaultfsError, match=r"has clones \(c\)"):
            await eng.forget_tag(tag)
        assert await eng.read_view(clone, 0, 2 * CS) == payload(CS * 2)

    trio.run(main)
    assert chunks(store, "t") == ["chunk_0", "chunk_1"]


def test_a_parent_is_not_registered_again_with_another_source_while_clones_read_its_blobs(
        store):
    data = payload(CS * 2)
    make_source(data)
    make_source(payload(CS * 3), "mem://new")
    eng = engine_for(store, prefetch_mb=0)
    tag = eng.register(ctx_for())
    eng.open_writes()

    async def main():
        await eng.read_view(tag, 0, len(data))
        await eng.clone_tag(tag, "c")
        await eng.close_writes()

    trio.run(main)
    eng.close()
    eng2 = engine_for(store, prefetch_mb=0)
    with pytest.raises(FaultfsError, match=r"clones \(c\) read its staged blobs"):
        eng2.register(ctx_for("mem://new"))
    assert chunks(store, "t") == ["chunk_0", "chunk_1"]
    eng2.close()


def test_gc_and_fsck_keep_the_blobs_a_registered_clone_reads_also_of_an_unregistered_parent(
        store):
    """The parent's registry entry gone (a clone cannot be made without one, and forget is
    refused while clones exist): its staged blobs are still what the registered clone names
    as its clean chunks, so gc keeps them, fsck reports them kept; the blobs of a tag nothing
    names still go."""
    data = payload(CS * 3)
    make_source(data)
    make_source(data, "mem://other")
    eng = engine_for(store, prefetch_mb=0)
    tag = eng.register(ctx_for())
    other = eng.register(ctx_for("mem://other", "other"))
    eng.open_writes()

    async def main():
        await eng.read_view(tag, 0, len(data))
        await eng.read_view(other, 0, len(data))
        await eng.clone_tag(tag, "c")
        await eng.close_writes()

    trio.run(main)
    eng.close()
    root = store.root
    report = gc(root, dry_run=True)
    assert report.files == 0, "the parent and its clone are registered: nothing to free"
    for name in (tag.key, other.key):
        store.delete(REGISTRY_TAG, name)  # both unregistered; only t has a registered clone
    walk = list(StoreWalk(root))
    kept = [f for f in walk if "tags/t-t/" in f.path]
    assert kept and all(f.status == ORPHANED and "clone" in f.keep for f in kept)
    report = gc(root)
    assert chunks(store, "t") == ["chunk_0", "chunk_1", "chunk_2"]
    assert chunks(store, "other") == [] and report.files >= 4  # 3 blobs and the tag state
    # registered again (the same context): the kept blobs are the clone's clean chunks again
    del MemoryAssimilator.sources["mem://x"]
    eng2 = engine_for(store, prefetch_mb=0)
    make_source(data)
    eng2.register(ctx_for())
    del MemoryAssimilator.sources["mem://x"]
    clone = {t.name: t for t in eng2.recover()}["c"]
    assert clone.clean.name == "t" and clone.source is None
    assert trio.run(eng2.read_view, clone, 0, len(data)) == data
    eng2.close()


# -- through a mount ----------------------------------------------------------------------------

def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.mount
def test_with_the_source_moved_away_a_clone_of_a_staged_tag_reads_every_byte(
        mounter, sample, tmp_path):
    """The issue's reproduction: a tag staged whole, cloned (and cloned again), the parent
    written after; unmounted, the source moved away, remounted with the store alone — the
    clones read the parent's bytes as at clone time (before: EIO), from the parent's blobs:
    no second copy in the store."""
    src = sample(3 * MiB + 5 * KiB)
    original = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    for i in range(4):
        read(os.path.join(tag, f"chunk_{i}"))
    run_faultfs("clone", tag, "c", check=True)
    run_faultfs("clone", m.tag("c"), "c2", check=True)
    with open(os.path.join(tag, "chunk_1"), "r+b") as f:  # the parent written after
        f.write(b"AFTER")
    assert read(os.path.join(m.tag("c"), "chunk_1")) == original[MiB:2 * MiB]
    assert m.counters()["source_reads"] == 4
    m.umount()
    shutil.move(src, tmp_path / "away.bin")
    m2 = mounter(store=m.store)
    for name in ("c", "c2"):
        assert read(os.path.join(m2.tag(name), "chunk_1")) == original[MiB:2 * MiB]
        assert read(os.path.join(m2.tag(name), "field.bin")) == original
    assert read(os.path.join(m2.tag("field"), "chunk_1"))[:5] == b"AFTER"
    assert m2.counters()["fault_errors"] == 0
    staged = os.listdir(os.path.join(m2.store, "tags"))
    assert sorted(s for s in staged if s.startswith("t-c")) in ([], ["t-c", "t-c2"])
    for name in ("t-c", "t-c2"):
        directory = os.path.join(m2.store, "tags", name)
        if os.path.isdir(directory):
            assert not [n for n in os.listdir(directory) if "chunk_" in n], "no second copy"


