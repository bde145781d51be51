"""The tree without a mount: entries, lookups, attributes and opens of faultfs.namespace."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest
import trio

from faultfs.core import inodes
from faultfs.core.inodes import CTL_DIR, KIND_CHUNK, REGISTRY_DIR, ROOT, STATS_FILE
from faultfs.errors import FaultfsError
from faultfs.namespace import Files, Tree
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import CS, ctx_for, engine_for, make_source, payload


@pytest.fixture
def tree(tmp_path):
    store = BlobStore(str(tmp_path / "store"))
    engine = engine_for(store)
    make_source(payload(3 * CS + 10), url="mem://ns/field.bin")
    make_source(payload(CS), url="mem://ns/other.bin")
    engine.register(ctx_for("mem://ns/field.bin", "field"))
    engine.register(ctx_for("mem://ns/other.bin", "other"))
    yield Tree(engine)
    engine.close()


def run(fn, *args):
    return trio.run(fn, *args)


def names(tree: Tree, inode: int, start: int = 0) -> list[str]:
    async def listing():
        return [name for _, name, _ in await tree.listing(inode, start)]
    return run(listing)


def errno_of(fn, *args) -> int:
    with pytest.raises(FaultfsError) as info:
        run(fn, *args)
    return info.value.errno


def test_the_root_lists_the_control_dir_and_the_tags(tree):
    assert names(tree, ROOT) == [".faultfs", "field", "other"]
    assert names(tree, ROOT, start=2) == ["other"]
    assert names(tree, CTL_DIR) == ["control", "metrics", "registry", "stats"]
    assert names(tree, REGISTRY_DIR) == sorted(tree.engine.registry)


def test_every_listed_name_looks_up_to_the_same_inode(tree):
    async def consistent(directory: int) -> None:
        for _, name, attr in await tree.listing(directory, 0):
            assert (await tree.lookup(directory, name)).inode == attr.inode

    for directory in (ROOT, CTL_DIR, REGISTRY_DIR):
        run(consistent, directory)
    field = run(tree.lookup, ROOT, "field")
    assert names(tree, field.inode) == ["field.bin", "chunk_0", "chunk_1", "chunk_2", "chunk_3"]
    assert names(tree, field.inode, start=3) == ["chunk_2", "chunk_3"]
    run(consistent, field.inode)


def test_attributes_of_chunks_and_the_view_follow_what_is_staged(tree):
    field = run(tree.lookup, ROOT, "field")
    assert stat.S_ISDIR(field.mode) and field.nlink == 2
    chunk = run(tree.lookup, field.inode, "chunk_1")
    view = run(tree.lookup, field.inode, "field.bin")
    assert stat.S_ISREG(chunk.mode) and chunk.size == CS
    assert view.size == 3 * CS + 10
    tag = tree.engine.tags["field"]
    run(tree.engine.read_blob, tag, 1, 0, 1)  # fault chunk_1
    assert run(tree.getattr, chunk.inode).staged_bytes == CS
    assert run(tree.getattr, view.inode).staged_bytes == CS


def test_names_that_are_not_entries_are_enoent(tree):
    field = run(tree.lookup, ROOT, "field").inode
    for name in ("chunk_4", "chunk_07", "chunk_+1", "chunk_", "page:0", ".pagemap", "nope",
                 "chunk_٣"):
        assert errno_of(tree.lookup, field, name) == errno.ENOENT, name
    assert errno_of(tree.lookup, ROOT, "missing") == errno.ENOENT
    assert errno_of(tree.getattr, inodes.make(99, KIND_CHUNK, 0)) == errno.ENOENT
    assert errno_of(tree.getattr, inodes.make(1, KIND_CHUNK, 4)) == errno.ENOENT
    chunk = run(tree.lookup, field, "chunk_0").inode
    assert errno_of(tree.lookup, chunk, "x") == errno.ENOTDIR


def test_pages_appear_with_a_pagemap(tree):
    tag = tree.engine.tags["field"]
    tree.engine.write_identity_pagemap(tag, 2 * CS)
    field = run(tree.lookup, ROOT, "field").inode
    assert names(tree, field) == ["field.bin", ".pagemap", "chunk_0", "chunk_1", "chunk_2",
                                  "chunk_3", "page:0", "page:1"]
    page = run(tree.lookup, field, "page:1")
    assert page.size == 2 * CS
    for name in ("page:2", "page:01", "page:-1", "page:"):
        assert errno_of(tree.lookup, field, name) == errno.ENOENT, name


def test_opens_read_through_the_engine_and_refuse_writes(tree):
    files = Files(tree)
    field = run(tree.lookup, ROOT, "field").inode
    view = run(tree.lookup, field, "field.bin").inode

    async def main():
        handle = await files.open(view, os.O_RDONLY)
        assert handle.keep_cache and not handle.direct_io
        assert bytes(await handle.read(CS - 5, 10)) == payload(3 * CS + 10)[CS - 5:CS + 5]
        stats = await files.open(STATS_FILE, os.O_RDONLY)
        assert stats.direct_io
        doc = json.loads(bytes(await stats.read(0, 1 << 20)))
        assert set(doc["tags"]) == {"field", "other"}
        key = sorted(tree.engine.registry)[0]
        entry = await files.open((await tree.lookup(REGISTRY_DIR, key)).inode, os.O_RDONLY)
        assert bytes(await entry.read(0, 1 << 20)) == tree.engine.registry[key]

    run(main)
    assert errno_of(files.open, STATS_FILE, os.O_WRONLY) == errno.EACCES
    assert errno_of(files.open, field, os.O_RDONLY) == errno.EISDIR
    assert errno_of(files.create, ROOT, ".pagemap", os.O_WRONLY) == errno.EROFS
    assert errno_of(files.create, field, "chunk_1", os.O_WRONLY) == errno.EPERM


def test_a_read_only_engine_refuses_writes(tmp_path):
    store = BlobStore(str(tmp_path / "store"))
    engine = engine_for(store, read_only=True)
    make_source(payload(CS), url="mem://ro/x.bin")
    engine.register(ctx_for("mem://ro/x.bin", "x"))
    tree = Tree(engine)
    files = Files(tree)
    field = run(tree.lookup, ROOT, "x").inode
    view = run(tree.lookup, field, "x.bin")
    assert view.mode & 0o222 == 0
    assert errno_of(files.open, view.inode, os.O_RDWR) == errno.EROFS
    assert errno_of(files.create, field, "newfile", os.O_WRONLY) == errno.EROFS
    engine.close()


def test_a_tag_of_a_million_chunks_lists_from_any_position_at_once(tmp_path):
    store = BlobStore(str(tmp_path / "store"))
    engine = engine_for(store)
    make_source(b"", url="mem://ns/huge", size=(1 << 20) * 512)
    tag = engine.register(ctx_for("mem://ns/huge", "huge", chunk_size=512))
    tree = Tree(engine)
    directory = inodes.make(tag.id, inodes.KIND_DIR)
    assert names(tree, directory, start=(1 << 20) - 1)[:2] == [f"chunk_{(1 << 20) - 2}",
                                                               f"chunk_{(1 << 20) - 1}"]
    engine.close()


def test_a_view_grown_sparsely_lists_the_chunks_written_not_every_one_it_could_hold(tree):
    """One byte written at 2^44-1 grew the view to 2^44 / CS chunks and the tag listed every
    one of them; it lists the source's chunks and those written past it (a hole is still
    found by name, reads zeros and holds no blocks)."""
    files = Files(tree)
    field = run(tree.lookup, ROOT, "field").inode
    view = run(tree.lookup, field, "field.bin").inode
    last = (1 << 44) // CS - 1

    async def write(off: int, data: bytes) -> None:
        handle = await files.open(view, os.O_RDWR)
        assert await handle.write(off, data) == len(data)
        await handle.release()

    run(write, (1 << 44) - 1, b"x")
    listed = names(tree, field)
    assert listed == ["field.bin", "chunk_0", "chunk_1", "chunk_2", "chunk_3", f"chunk_{last}"]
    assert names(tree, field, start=4) == ["chunk_3", f"chunk_{last}"]
    assert names(tree, field, start=6)[:1] == [f"chunk_{last}"]
    run(write, 9 * CS, b"y")
    assert names(tree, field)[-2:] == ["chunk_9", f"chunk_{last}"]
    assert run(tree.getattr, run(tree.lookup, field, "chunk_9").inode).staged_bytes == CS
    hole = run(tree.lookup, field, "chunk_100")
    assert hole.size == CS and hole.staged_bytes == 0 and hole.blocks == 1
    run(consistent_listing, tree, field)


async def consistent_listing(tree: Tree, directory: int) -> None:
    for _, name, attr in await tree.listing(directory, 0):
        assert (await tree.lookup(directory, name)).inode == attr.inode


def test_rename_flags_are_honoured_or_refused_never_ignored(tree):
    """renameat2 at the namespace: the kernel refuses some flag mixes itself, the namespace
    refuses them too (both flags, RENAME_WHITEOUT, unknown bits: EINVAL), before any change."""
    from faultfs.namespace import RENAME_EXCHANGE, RENAME_NOREPLACE

    files = Files(tree)
    field = run(tree.lookup, ROOT, "field").inode
    writes = tree.engine.writes
    tag = tree.engine.tags["field"]

    async def main():
        for name, data in (("a", b"aa"), ("b", b"bbbb")):
            await writes.create_user(tag, name)
            await writes.write_user(tag, name, 0, data)

    run(main)

    def user_blobs() -> dict[str, bytes]:
        return {n: bytes(run(writes.read_user, tag, n, 0, 100)) for n in writes.user_names(tag)}

    before = user_blobs()
    for flags in (RENAME_NOREPLACE | RENAME_EXCHANGE, 4, 8, 1 << 31):
        assert errno_of(files.rename, field, "a", field, "b", flags) == errno.EINVAL, flags
    for target in ("b", "chunk_0", "field.bin"):
        assert errno_of(files.rename, field, "a", field, target, RENAME_NOREPLACE) == errno.EEXIST
    assert errno_of(files.rename, field, "a", field, "c", RENAME_EXCHANGE) == errno.ENOENT
    assert errno_of(files.rename, field, "a", field, "chunk_1", RENAME_EXCHANGE) == errno.EPERM
    assert errno_of(files.rename, field, "chunk_1", field, "a", RENAME_EXCHANGE) == errno.EPERM
    assert user_blobs() == before
    run(files.rename, field, "a", field, "b", RENAME_EXCHANGE)
    assert user_blobs() == {"a": b"bbbb", "b": b"aa"}
    run(files.rename, field, "a", field, "c", RENAME_NOREPLACE)
    assert user_blobs() == {"b": b"aa", "c": b"bbbb"}


def test_o_trunc_is_a_write_whatever_the_access_mode(tree):
    """O_TRUNC of a fixed-size name is EPERM (as truncate of it is), of a read-only file
    refused as a write is; the kernel hands O_TRUNC to the open (atomic_o_trunc)."""
    files = Files(tree)
    field = run(tree.lookup, ROOT, "field").inode
    chunk = run(tree.lookup, field, "chunk_1").inode
    key = sorted(tree.engine.registry)[0]
    entry = run(tree.lookup, REGISTRY_DIR, key).inode
    for mode in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
        assert errno_of(files.open, chunk, mode | os.O_TRUNC) == errno.EPERM, mode
        assert errno_of(files.open, STATS_FILE, mode | os.O_TRUNC) == errno.EACCES, mode
        assert errno_of(files.open, entry, mode | os.O_TRUNC) == errno.EROFS, mode
    assert not tree.engine.writes.is_dirty(tree.engine.tags["field"], 1)
    assert files.opened == set(), "a refused open leaves nothing open"
