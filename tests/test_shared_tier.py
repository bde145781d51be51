"""The shared tier with a directory as the object store: several daemons, each with its own
local store and mountpoint, sharing registrations and clean blobs (DESIGN §13). The S3
endpoint cases are in tests/s3/test_mount_shared.py; this file holds what does not need one,
and the decoders against hostile objects."""

from __future__ import annotations

import errno
import os
import time

import pytest
from conftest import run_faultfs

from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.blobfile import HEADER_LEN
from faultfs.tiers.base import TierTag
from faultfs.tiers.objects import LocalObjects
from faultfs.tiers.shared import blob_object_key, decode_blob_object, encode_blob_object

MiB = 1 << 20
ANY = 64 << 20  # the objects these tests read back are smaller
pytestmark = pytest.mark.mount
NODE = ["--chunk-size", "1M", "--prefetch-mb", "0"]


def read(path: str, off: int = 0, size: int = -1) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(size)


def read_errno(path: str) -> int | None:
    try:
        read(path)
    except OSError as exc:
        return exc.errno
    return None


def settled(m, timeout: float = 10.0) -> dict:
    """The node's counters once its publishes are done."""
    deadline = time.monotonic() + timeout
    while True:
        stats = m.stats()
        if not stats["shared"]["publishes_pending"] or time.monotonic() > deadline:
            return stats["counters"]
        time.sleep(0.05)


@pytest.fixture
def nodes(mounter, tmp_path):
    """``node(name, *sources, args=...)``: a daemon with its own store, on one shared store."""
    shared = str(tmp_path / "shared")

    def node(name: str, *sources: str, args=(), store: str | None = None):
        return mounter(*sources, store=store or str(tmp_path / f"store-{name}"),
                       args=[*NODE, "--shared-store", shared, *args])

    node.shared = shared
    return node


def test_a_node_without_the_source_serves_what_another_staged(nodes, sample, tmp_path):
    src = sample(5 * MiB + 77)
    data = read(src)
    a = nodes("a", src)
    assert read(os.path.join(a.tag("field"), "chunk_1")) == data[MiB:2 * MiB]
    assert read(os.path.join(a.tag("field"), "chunk_4")) == data[4 * MiB:5 * MiB]
    assert settled(a)["shared_publishes"] == 2
    os.rename(src, src + ".gone")  # node B's machine has no copy of the source
    b = nodes("b")  # no source, an empty local store: the tags come from the shared store
    assert sorted(os.listdir(b.path)) == [".faultfs", "field"]
    tag = b.tag("field")
    assert os.path.getsize(os.path.join(tag, "field.bin")) == len(data)
    assert read(os.path.join(tag, "chunk_1")) == data[MiB:2 * MiB]
    assert read(os.path.join(tag, "field.bin"), 4 * MiB + 3, 1000) == data[4 * MiB + 3:4 * MiB + 1003]
    c = b.counters()
    assert c["source_reads"] == 0 and c["shared_hits"] == 2
    # what A never staged: EIO, never zeros, and the log says why
    assert read_errno(os.path.join(tag, "chunk_2")) == errno.EIO
    with open(os.path.join(b.store, "log", "faultfs.log")) as f:
        assert "source is unreachable from this node" in f.read()
    # a hit filled B's local store: after a remount B serves it without the shared store
    b.umount()
    assert os.path.exists(os.path.join(b.store, "tags"))
    b2 = nodes("b", store=b.store)
    assert read(os.path.join(b2.tag("field"), "chunk_1")) == data[MiB:2 * MiB]
    assert b2.counters()["shared_hits"] == 0


def test_a_node_with_the_source_fills_in_what_the_tier_lacks_and_publishes_it(nodes, sample):
    src = sample(4 * MiB)
    data = read(src)
    a = nodes("a", src)
    read(os.path.join(a.tag("field"), "chunk_0"))
    read(os.path.join(a.tag("field"), "chunk_1"))
    settled(a)
    b = nodes("b")  # the same path exists here: B can read the source itself
    assert read(os.path.join(b.tag("field"), "field.bin")) == data
    c = settled(b)
    assert c["shared_hits"] == 2 and c["source_bytes"] == 2 * MiB and c["shared_publishes"] == 2
    c3 = nodes("c")
    assert read(os.path.join(c3.tag("field"), "field.bin")) == data
    assert c3.counters()["source_reads"] == 0 and c3.counters()["shared_hits"] == 4


@pytest.mark.parametrize("damage", ["garbage", "truncated", "flipped", "other-blob"])
def test_a_damaged_object_is_never_served_and_is_replaced(nodes, sample, damage):
    src = sample(3 * MiB)
    data = read(src)
    a = nodes("a", src)
    read(os.path.join(a.tag("field"), "field.bin"))
    settled(a)
    objects = LocalObjects(nodes.shared)
    keys = [k for k in objects.list("blobs/")]
    assert len(keys) == 3
    victim = sorted(keys)[1]
    raw = objects.get(victim, limit=ANY)
    bad = {"garbage": b"not a blob" * 100, "truncated": raw[:HEADER_LEN + 100],
           "flipped": raw[:HEADER_LEN + 5] + bytes([raw[HEADER_LEN + 5] ^ 1]) + raw[HEADER_LEN + 6:],
           "other-blob": objects.get(sorted(keys)[0], limit=ANY)}[damage]
    objects.put(victim, bad)
    b = nodes("b")
    assert read(os.path.join(b.tag("field"), "field.bin")) == data  # re-faulted, not served
    c = settled(b)
    assert c["shared_damaged"] == 1 and c["source_reads"] == 1 and c["shared_publishes"] == 1
    assert objects.get(victim, limit=ANY) == raw  # republished over it


def test_a_tag_name_another_context_owns_is_refused_and_nothing_changes(nodes, sample, tmp_path):
    src = sample(2 * MiB)
    nodes("a", src)
    other = tmp_path / "other" / "field.bin"
    other.parent.mkdir()
    other.write_bytes(b"x" * 1000)
    store = tmp_path / "store-b"
    mnt = tmp_path / "mnt-b"
    mnt.mkdir()
    r = run_faultfs("mount", str(other), str(mnt), "--store", str(store), *NODE,
                    "--shared-store", nodes.shared)
    assert r.returncode != 0
    line = r.stderr.strip()
    assert "\n" not in line and "registered in the shared store" in line and src in line
    assert not store.exists() and os.listdir(mnt) == []
    # the same context again is a no-op
    b = nodes("b", src)
    assert read(os.path.join(b.tag("field"), "chunk_0")) == read(src)[:MiB]


@pytest.mark.parametrize("where", ["a-file", "unwritable"])
def test_a_shared_store_that_cannot_be_used_refuses_the_mount(sample, tmp_path, where):
    src = sample(MiB)
    if where == "a-file":
        shared = tmp_path / "plain-file"
        shared.write_bytes(b"x")
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        shared = ro / "shared"
        run = ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)]
        import subprocess

        subprocess.run(run, check=True)
    try:
        store, mnt = tmp_path / "store", tmp_path / "mnt"
        mnt.mkdir()
        r = run_faultfs("mount", src, str(mnt), "--store", str(store), "--shared-store",
                        str(shared))
        assert r.returncode != 0
        assert "shared store" in r.stderr and "cannot be used" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert not store.exists() and os.listdir(mnt) == []
    finally:
        if where == "unwritable":
            import subprocess

            subprocess.run(["umount", str(tmp_path / "ro")], check=True)


def test_a_pagemap_is_shared(nodes, sample):
    src = sample(2 * MiB)
    a = nodes("a", src, args=["--page-size", "512K"])
    page1 = read(os.path.join(a.tag("field"), "page:1"))
    assert page1 == read(src, 512 * 1024, 512 * 1024)
    b = nodes("b")
    assert read(os.path.join(b.tag("field"), "page:1")) == page1


# -- the blob object's decoder against hostile bytes ------------------------------------------

def _tag(version: str = "4194304 mtime:1") -> TierTag:
    return TierTag(1, "t", version, 4, 4096, lambda i: f"chunk_{i}",
                   lambda n: int(n[6:]) if n.startswith("chunk_") else None, "fault:0123456789abcdef")


def test_blob_objects_round_trip_and_refuse_every_other_object():
    tag = _tag()
    payload = os.urandom(4096)
    obj = b"".join(encode_blob_object(tag, 2, payload))
    assert bytes(decode_blob_object(tag, 2, obj)) == payload
    zeros = b"".join(encode_blob_object(tag, 1, bytes(4096)))
    assert len(zeros) == HEADER_LEN and bytes(decode_blob_object(tag, 1, zeros)) == bytes(4096)
    for bad in [obj[:-1], obj + b"x", b"", obj[:50] + bytes([obj[50] ^ 1]) + obj[51:],
                obj[:-1] + bytes([obj[-1] ^ 1])]:
        with pytest.raises(CorruptionError):
            decode_blob_object(tag, 2, bad)
    with pytest.raises(CorruptionError, match="not t/chunk_3"):
        decode_blob_object(tag, 3, obj)  # another blob's object
    with pytest.raises(CorruptionError, match="another source version"):
        decode_blob_object(_tag("4194304 mtime:2"), 2, obj)
    assert blob_object_key(tag, 2).startswith("blobs/0123456789abcdef/")
    assert blob_object_key(tag, 2) != blob_object_key(_tag("4194304 mtime:2"), 2)


def test_local_objects_put_create_never_replaces(tmp_path):
    objects = LocalObjects(str(tmp_path / "o"))
    assert objects.put("a/b", b"1", create=True)
    assert not objects.put("a/b", b"2", create=True)
    assert objects.get("a/b", limit=ANY) == b"1"
    assert objects.put("a/b", b"3")
    assert objects.get("a/b", limit=ANY) == b"3" and objects.list("a/") == ["a/b"]
    os.mkfifo(tmp_path / "o" / "fifo")
    assert objects.get("fifo", limit=ANY) is None  # never blocks on a FIFO
    objects.delete("a/b")
    assert objects.list("a/") == [] and objects.get("a/b", limit=ANY) is None


def test_sealed_objects_serve_only_what_the_key_sealed(tmp_path):
    """With a cluster key, an object is used only when its seal verifies: not one a node
    without the key put, not one forged with a trailer of its own, not a sealed object
    moved to another key; without the key, a sealed object reads as its bytes."""
    from faultfs.tiers.sealed import MAGIC, TRAILER_LEN, SealedObjects, load_key

    (tmp_path / "k").write_text("ab" * 32)
    (tmp_path / "other").write_text("cd" * 32)
    plain = LocalObjects(str(tmp_path / "o"))
    keyed = SealedObjects(plain, load_key(str(tmp_path / "k")))
    other = SealedObjects(plain, load_key(str(tmp_path / "other")))
    unkeyed = SealedObjects(plain, None)
    assert keyed.put("a", b"data") and keyed.get("a", limit=4) == b"data"
    assert len(plain.get("a", limit=ANY)) == 4 + TRAILER_LEN
    assert unkeyed.get("a", limit=4) == b"data"
    with pytest.raises(CorruptionError, match="does not verify"):
        other.get("a", limit=4)  # another cluster's key
    plain.put("b", plain.get("a", limit=ANY))  # moved: the key is under the seal
    with pytest.raises(CorruptionError, match="does not verify"):
        keyed.get("b", limit=4)
    unkeyed.put("c", b"data")
    with pytest.raises(CorruptionError, match="not sealed"):
        keyed.get("c", limit=4)
    plain.put("d", b"data" + MAGIC + os.urandom(32))
    with pytest.raises(CorruptionError, match="does not verify"):
        keyed.get("d", limit=4)
    keyed.put("e", b"x" * 100)
    assert len(keyed.get("e", limit=10)) == 11  # longer than its kind: refused by length
    assert keyed.get("absent", limit=4) is None
    for text in ("short", "", "x" * 5000):
        (tmp_path / "bad").write_text(text)
        with pytest.raises(InvalidInput, match="shared store key"):
            load_key(str(tmp_path / "bad"))


def test_tags_other_nodes_register_later_appear_on_a_live_mount(nodes, sample, tmp_path):
    first = sample(2 * MiB, "first.bin")
    a = nodes("a", first)
    read(os.path.join(a.tag("first"), "chunk_0"))
    settled(a)
    b = nodes("b")
    assert sorted(os.listdir(b.path)) == [".faultfs", "first"]
    later = sample(3 * MiB, "later.bin", seed=5)
    c = nodes("c", later)  # registered after B mounted
    read(os.path.join(c.tag("later"), "chunk_2"))
    settled(c)
    # a lookup of the new name finds it (B looks in the shared store)...
    tag = os.path.join(b.path, "later")
    deadline = time.monotonic() + 15
    while not os.path.isdir(tag):  # a refresh runs at most every few seconds
        assert time.monotonic() < deadline, "the new tag never appeared on B"
        time.sleep(0.5)
    assert read(os.path.join(tag, "chunk_2")) == read(later)[2 * MiB:]
    assert b.counters()["shared_hits"] >= 1
    # ...and so does a listing
    assert sorted(os.listdir(b.path)) == [".faultfs", "first", "later"]
    # a tag B forgot is not brought back by a refresh
    run_faultfs("forget", os.path.join(b.path, "first"), check=True)
    time.sleep(5.5)
    assert sorted(os.listdir(b.path)) == [".faultfs", "later"]
