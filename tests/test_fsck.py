"""``faultfs fsck`` and ``faultfs gc`` (``faultfs.store.fsck``, ``faultfs.store.gc``): stores
built through real mounts, then damaged on purpose in every way a store can be (flipped payload
byte, truncated file, FIFO and directory where blobs belong, bad header, stale version, temp
files, a tag without a registry entry and an entry without a tag, a damaged dirty file, an
unparsable pagemap, a torn journal tail); each is found, ``--repair`` fixes exactly the clean
ones and keeps dirty data and the journal byte for byte, and a remount reads correct bytes.
gc frees unregistered tags, old versions and temp files; both refuse a live store. The
journal's verdicts and the walk's memory are checked on stores made without a mount.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import random
import subprocess
import threading
import time
import tracemalloc

import pytest
from conftest import run_faultfs

from faultfs.cli import fsck as fsck_cli
from faultfs.cli import gc as gc_cli
from faultfs.cli.common import OneLineParser
from faultfs.core.context import REGISTRY_TAG, FaultContext
from faultfs.store.blobfile import FLAG_DIRTY, FLAG_NO_FAULT, HEADER_LEN
from faultfs.store.blobstore import BlobStore, encode_component
from faultfs.store.fsck import BLOBS, StoreLock, StoreWalk
from faultfs.store.journal import KIND_WRITE, Journal, Record, encode
from faultfs.store.registry import Registry
from faultfs.store.tagstate import TagState, read_tag_state, write_tag_state

KiB = 1 << 10
CHUNK = 256 * KiB
mount = pytest.mark.mount


def cli(*argv: str) -> tuple[int, str, str]:
    """Run ``faultfs fsck|gc ...`` in this process, as ``faultfs.cli.main`` would once they
    are registered: ``(exit status, stdout, stderr)``."""
    parser = OneLineParser(prog="faultfs")
    sub = parser.add_subparsers(dest="command")
    sub.required = True
    fsck_cli.register(sub)
    gc_cli.register(sub)
    args = parser.parse_args(list(argv))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = args.func(args)
    return code, out.getvalue(), err.getvalue()


def fsck_json(store: str, *extra: str) -> tuple[int, dict]:
    code, out, err = cli("fsck", store, "--json", *extra)
    assert code in (0, 1), err
    return code, json.loads(out)


def problems(doc: dict) -> dict[str, tuple[str, str]]:
    """path -> (status, action) of every problem of a report."""
    assert doc["problems_omitted"] == 0
    return {p["path"]: (p["status"], p["action"]) for p in doc["problems"]}


def files_under(root: str, *, skip: tuple[str, ...] = ("lock", "log")) -> dict[str, bytes]:
    """Every regular file under ``root`` (relative path -> bytes)."""
    out = {}
    for base, _dirs, names in os.walk(root):
        rel_base = os.path.relpath(base, root)
        if rel_base.split(os.sep)[0] in skip:
            continue
        for name in names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, root)
            if rel in skip or not os.path.isfile(path) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                out[rel] = f.read()
    return out


def dirty_data(store: str) -> dict[str, bytes]:
    """The bytes no repair may touch: writes (dirty files, write states, the journal; not the
    temp files of interrupted writes) and pagemaps."""
    found = {f"writes/{k}": v for k, v in files_under(os.path.join(store, "writes")).items()
             if not os.path.basename(k).startswith("t-")}
    for rel, data in files_under(os.path.join(store, "tags")).items():
        if rel.endswith("/b-pagemap"):
            found[f"tags/{rel}"] = data
    return found


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def pwrite_synced(path: str, off: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.pwrite(fd, data, off) == len(data)
        os.fsync(fd)
    finally:
        os.close(fd)


def flip(path: str, off: int) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        byte = f.read(1)
        f.seek(off)
        f.write(bytes([byte[0] ^ 0xFF]))


def registry_path(store: str, key: str) -> str:
    return os.path.join(store, "tags", encode_component("t-", REGISTRY_TAG),
                        encode_component("b-", key))


def last_segment(store: str) -> str:
    directory = os.path.join(store, "writes", "journal")
    return os.path.join(directory, sorted(os.listdir(directory))[-1])


def make_temp(path: str, data: bytes = b"half a blob") -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def stage_all(path: str) -> bytes:
    return read(path)


# -- through real mounts --------------------------------------------------------------------

@mount
def test_fsck_finds_every_planted_damage_and_repair_fixes_exactly_the_clean_ones(
        mounter, sample, tmp_path):
    field = sample(8 * CHUNK, "field.bin")
    other = sample(4 * CHUNK, "other.bin", seed=1)
    ghost_src = sample(2 * CHUNK, "ghost.bin", seed=2)
    m = mounter(field, args=["--chunk-size", "256K", "--page-size", "256K"])
    tag = m.tag("field")
    source = read(field)
    assert stage_all(os.path.join(tag, "field.bin")) == source
    patch = os.urandom(4096)
    pwrite_synced(os.path.join(tag, "chunk_3"), 1000, patch)  # a dirty chunk, intact
    with open(os.path.join(tag, "notes.txt"), "wb") as f:  # a user blob, damaged below
        f.write(b"notes of the run\n")
        f.flush()
        os.fsync(f.fileno())
    m.umount()
    store = m.store
    m2 = mounter(other, store=store, args=["--chunk-size", "256K", "--prefetch-mb", "0"])
    assert read(os.path.join(m2.tag("other"), "chunk_0")) == read(other)[:CHUNK]
    assert read(os.path.join(m2.tag("other"), "chunk_1")) == read(other)[CHUNK:2 * CHUNK]
    m2.umount()

    code, doc = fsck_json(store)
    assert (code, doc["problems"]) == (0, []), "a store two clean unmounts left is clean"
    assert doc["areas"]["blobs"]["ok"] == 8 + 2 and doc["areas"]["pagemaps"]["ok"] == 1
    assert doc["areas"]["dirty blobs"]["ok"] == 2 and doc["areas"]["write states"]["ok"] == 1

    # -- plant damage of every kind ------------------------------------------------------------
    tdir = os.path.join(store, "tags", "t-field")
    wdir = os.path.join(store, "writes", "t-field")
    blob = {i: os.path.join(tdir, f"b-chunk_{i}") for i in range(8)}
    flip(blob[0], HEADER_LEN + 20000)  # a flipped payload byte (of block 1: 16 KiB blocks)
    os.truncate(blob[1], HEADER_LEN + 100)  # a truncated file
    flip(blob[2], 58)  # a bad header (a byte of the tag's name: the header checksum fails)
    plant = BlobStore(store, create=False)
    plant.put("field", "chunk_4", source[4 * CHUNK:5 * CHUNK], flags=FLAG_NO_FAULT,
              source_version="1 mtime_ns:1")  # staged from another version of the source
    os.unlink(blob[5])
    os.mkfifo(blob[5])  # a FIFO where a blob should be
    os.unlink(blob[6])
    os.mkdir(blob[6])  # a directory where a blob should be
    make_temp(os.path.join(blob[6], "inside"))
    temps = [make_temp(os.path.join(tdir, "t-0123456789abcdef.tmp")),
             make_temp(os.path.join(wdir, "t-00000000deadbeef.tmp")),
             make_temp(os.path.join(store, ".probe-1234abcd"), b"x")]
    other_state = read_tag_state(plant, "other")
    assert other_state is not None
    os.unlink(registry_path(store, other_state.key))  # a tag without a registry entry
    ghost = FaultContext(src=f"file::{ghost_src}", dst="ghost", chunk_size=CHUNK)
    Registry(plant).put(ghost)  # a registry entry without a tag
    notes = [n for n in os.listdir(wdir) if n.startswith("b-u%3A")]
    assert len(notes) == 1
    flip(os.path.join(wdir, notes[0]), HEADER_LEN + 3)  # a damaged dirty file
    plant.put("field", "pagemap", b"this is no pagemap\n", flags=FLAG_DIRTY)  # user data, unparsable
    segment = last_segment(store)
    torn = encode(Record(99, KIND_WRITE, "field", "chunk_7", 0, 4, b"abcd"))
    with open(segment, "ab") as f:
        f.write(torn[:40])  # a torn journal tail
    kept_bytes = dirty_data(store)
    before = files_under(store)

    rel = os.path.relpath
    expected = {
        rel(blob[0], store): "damaged", rel(blob[1], store): "damaged",
        rel(blob[2], store): "damaged", rel(blob[5], store): "damaged",
        rel(blob[6], store): "damaged", rel(os.path.join(tdir, "b-chunk_4"), store): "stale",
        "tags/t-other/tag.json": "orphaned", "tags/t-other/b-chunk_0": "orphaned",
        "tags/t-other/b-chunk_1": "orphaned",
    }
    kept = {
        rel(registry_path(store, ghost.key), store): "orphaned",
        rel(os.path.join(wdir, notes[0]), store): "damaged",
        "tags/t-field/b-pagemap": "damaged",
    }
    # what a crash leaves and the next mount clears: listed, no problem (temp files dropped
    # by a repair, the journal kept)
    leftovers = {rel(t, store) for t in temps} | {rel(segment, store)}

    code, doc = fsck_json(store)
    assert code == 1
    found = problems(doc)
    assert {p: s for p, (s, _) in found.items()} == {**expected, **kept}
    assert {p["path"] for p in doc["leftovers"]} == leftovers
    assert doc["total"]["leftover"] == len(leftovers)
    assert files_under(store) == before, "fsck without --repair changes nothing"
    reasons = {p["path"]: p["reason"] for p in doc["problems"] + doc["leftovers"]}
    assert "torn tail" in reasons[rel(segment, store)]
    assert "block 1 failed its checksum" in reasons[rel(blob[0], store)]
    assert "a FIFO" in reasons[rel(blob[5], store)]
    assert "a directory" in reasons[rel(blob[6], store)]
    assert "no registry entry" in reasons["tags/t-other/b-chunk_0"]
    assert "has no tag state" in reasons[rel(registry_path(store, ghost.key), store)]
    assert "does not parse" in reasons["tags/t-field/b-pagemap"]
    assert doc["total"]["damaged"] == 7 and doc["total"]["stale"] == 1

    code, out, _ = cli("fsck", store)  # the text form: one line per problem, then the table
    assert code == 1
    lines = out.splitlines()
    assert sum(line.startswith(("damaged", "stale", "orphaned")) for line in lines) == len(found)
    assert sum(line.startswith("leftover") for line in lines) == len(leftovers)
    assert any(line.startswith("total") for line in lines)
    assert lines[-1].startswith(f"{len(found)} problems: {len(expected)} that --repair drops")

    code, doc = fsck_json(store, "--repair")
    assert code == 1
    found = problems(doc)
    assert found == {**{p: (s, "dropped") for p, s in expected.items()},
                     **{p: (s, "kept") for p, s in kept.items()}}
    assert {p["path"]: p["action"] for p in doc["leftovers"]} == {
        **{rel(t, store): "dropped" for t in temps}, rel(segment, store): ""}
    assert doc["dropped"]["files"] == len(expected) + len(temps) and doc["kept"] == len(kept)
    for path in [*expected, *(rel(t, store) for t in temps)]:
        assert not os.path.lexists(os.path.join(store, path)), path
    assert not os.path.lexists(os.path.join(store, "tags", "t-other")), "an orphaned tag goes whole"
    assert dirty_data(store) == kept_bytes, "dirty data and the journal are untouched"
    assert os.path.exists(registry_path(store, ghost.key))

    code, doc = fsck_json(store)
    assert code == 1
    assert problems(doc) == {p: (s, "") for p, s in kept.items()}, "only the kept damage is left"

    m3 = mounter(store=store)
    tag = m3.tag("field")
    expected_view = source[:3 * CHUNK + 1000] + patch + source[3 * CHUNK + 1000 + len(patch):]
    assert read(os.path.join(tag, "field.bin")) == expected_view
    for i in range(8):
        assert read(os.path.join(tag, f"chunk_{i}")) == expected_view[i * CHUNK:(i + 1) * CHUNK]
    with pytest.raises(OSError) as exc:
        read(os.path.join(tag, "notes.txt"))
    assert exc.value.errno == errno.EIO, "a damaged dirty blob reads as EIO, never re-faulted"
    assert sorted(os.listdir(m3.path)) == [".faultfs", "field", "ghost"]
    assert read(os.path.join(m3.tag("ghost"), "ghost.bin")) == read(ghost_src)


@mount
def test_a_store_of_clones_user_blobs_and_pages_is_clean_and_gc_frees_nothing(mounter, sample):
    field = sample(4 * CHUNK, "field.bin")
    m = mounter(field, args=["--chunk-size", "256K", "--page-size", "128K"])
    tag = m.tag("field")
    pwrite_synced(os.path.join(tag, "chunk_1"), 5, b"parent")
    run_faultfs("clone", tag, "copy", check=True)  # its dirty files are the parent's, linked
    pwrite_synced(os.path.join(m.tag("copy"), "chunk_2"), 9, b"child")
    with open(os.path.join(tag, "notes.txt"), "wb") as f:
        f.write(b"a user blob")
    assert read(os.path.join(m.tag("copy"), "chunk_1"))[5:11] == b"parent"
    m.umount()
    linked = os.path.join(m.store, "writes", "t-copy", "b-chunk_1")
    assert os.stat(linked).st_nlink == 2, "the clone's file is the parent's (its header says so)"
    code, doc = fsck_json(m.store)
    assert (code, doc["problems"]) == (0, [])
    assert doc["areas"]["dirty blobs"]["ok"] >= 4 and doc["areas"]["pagemaps"]["ok"] >= 1
    code, out, _ = cli("gc", m.store)
    assert (code, out.splitlines()[0]) == (0, f"gc {m.store}: freed 0 files, 0 B")


@mount
def test_the_journal_of_a_killed_mount_verifies_and_a_torn_tail_is_reported_as_such(
        mounter, sample):
    field = sample(4 * CHUNK, "field.bin")
    m = mounter(field, args=["--chunk-size", "256K"])
    view = os.path.join(m.tag("field"), "field.bin")
    writes = [(100, b"first"), (CHUNK + 7, b"second"), (3 * CHUNK + 9, b"third")]
    for off, data in writes:
        pwrite_synced(view, off, data)
    # the faulted chunks are stored behind the writes: a kill in the middle of one would
    m.wait_staged("field", 3, timeout=30)  # leave a clean blob to repair
    m.crash()  # the writes stay in the journal, not folded
    assert m.wait_gone(), "the daemon did not end on SIGKILL"
    subprocess.run(["fusermount3", "-u", "-z", m.path], capture_output=True)
    store = m.store

    code, doc = fsck_json(store)
    assert (code, doc["problems"]) == (0, []), "a journal of acknowledged records verifies"
    segment = last_segment(store)
    assert os.path.getsize(segment) > 0
    os.truncate(segment, os.path.getsize(segment) - 3)  # the last record is torn
    journal_bytes = read(segment)

    for extra in ((), ("--repair",)):
        code, doc = fsck_json(store, *extra)
        assert (code, doc["problems"]) == (0, []), "a torn tail is what a crash leaves"
        [left] = doc["leftovers"]
        assert left["area"] == "journal segments" and left["keep"] == "the journal"
        assert "torn tail" in left["reason"] and "after 2 good records" in left["reason"]
        assert "the next mount cuts it off" in left["reason"]
        assert read(segment) == journal_bytes, "the journal is never repaired"

    m2 = mounter(store=store)
    got = read(os.path.join(m2.tag("field"), "field.bin"))
    expected = bytearray(read(field))
    for off, data in writes[:2]:
        expected[off:off + len(data)] = data
    assert got == bytes(expected), "the replay keeps the records before the torn one"


@mount
def test_gc_frees_unregistered_tags_old_versions_and_temp_files_and_never_dirty_data(
        mounter, sample):
    field = sample(6 * CHUNK, "field.bin")
    other = sample(3 * CHUNK, "other.bin", seed=1)
    m = mounter(field, other, args=["--chunk-size", "256K"])
    source = read(field)
    assert read(os.path.join(m.tag("field"), "field.bin")) == source
    assert read(os.path.join(m.tag("other"), "other.bin")) == read(other)
    pwrite_synced(os.path.join(m.tag("field"), "chunk_5"), 10, b"kept")
    pwrite_synced(os.path.join(m.tag("other"), "chunk_0"), 20, b"orphaned but dirty")
    m.umount()
    store = m.store
    plant = BlobStore(store, create=False)
    for i in (1, 2):  # blobs of an old version of the source
        plant.put("field", f"chunk_{i}", source[i * CHUNK:(i + 1) * CHUNK], flags=FLAG_NO_FAULT,
                  source_version="7 etag:old")
    other_state = read_tag_state(plant, "other")
    assert other_state is not None
    os.unlink(registry_path(store, other_state.key))  # "other" is no longer registered
    temp = make_temp(os.path.join(store, "tags", "t-field", "t-0123456789abcdef.tmp"), b"t" * 100)
    other_dir = os.path.join(store, "tags", "t-other")
    other_bytes = sum(os.path.getsize(os.path.join(other_dir, n)) for n in os.listdir(other_dir))
    old_bytes = sum(os.path.getsize(os.path.join(store, "tags", "t-field", f"b-chunk_{i}"))
                    for i in (1, 2))
    kept_bytes = dirty_data(store)
    before = files_under(store)

    code, out, _ = cli("gc", store, "--dry-run")
    assert code == 0
    assert out.splitlines()[0] == (f"gc {store}: would free {4 + 2 + 1} files, "
                                   f"{fsck_cli.format_size(other_bytes + old_bytes + 100)}")
    assert files_under(store) == before, "--dry-run removes nothing"

    code, out, _ = cli("gc", store, "--verbose")
    assert code == 0
    lines = out.splitlines()
    assert lines[-4] == f"gc {store}: freed 7 files, {fsck_cli.format_size(other_bytes + old_bytes + 100)}"
    counts = {line.split(None, 3)[-1]: int(line.split()[0]) for line in lines[-3:]}
    assert counts == {"blobs and states of tags no longer registered": 4,
                      "blobs of old source versions": 2, "temp files of interrupted writes": 1}
    assert sum("dropped" in line for line in lines[:-4]) == 7
    assert not os.path.exists(other_dir) and not os.path.exists(temp)
    assert dirty_data(store) == kept_bytes, "gc never touches dirty data"
    assert os.path.isdir(os.path.join(store, "writes", "t-other"))

    code, out, _ = cli("gc", store)
    assert (code, out.splitlines()[0]) == (0, f"gc {store}: freed 0 files, 0 B")

    m2 = mounter(store=store)
    expected = bytearray(source)
    expected[5 * CHUNK + 10:5 * CHUNK + 14] = b"kept"
    assert read(os.path.join(m2.tag("field"), "field.bin")) == bytes(expected)
    assert sorted(os.listdir(m2.path)) == [".faultfs", "field"]


@mount
def test_fsck_and_gc_refuse_a_store_a_live_mount_owns_and_never_block_a_mount(
        mounter, sample, tmp_path):
    field = sample(2 * CHUNK, "field.bin")
    m = mounter(field, args=["--chunk-size", "256K"])
    read(os.path.join(m.tag("field"), "chunk_0"))
    store = m.store
    # blobs are stored behind the readers: wait until the daemon counts it (its file
    m.wait_staged("field", 1, timeout=30)  # appears before it is written)
    before = files_under(store)
    for argv in (("fsck", store), ("fsck", store, "--repair"), ("gc", store),
                 ("gc", store, "--dry-run")):
        code, out, err = cli(*argv)
        assert code == 2, argv
        assert out == "" and err.count("\n") == 1, err
        assert f"is in use by pid {m.pid}" in err and "unmount it first" in err
    code, out, _ = cli("fsck", store, "--json")
    assert code == 2 and json.loads(out)["exit"] == 2
    assert files_under(store) == before
    m.umount()
    assert cli("fsck", store)[0] == 0

    mnt = tmp_path / "while-checked"
    mnt.mkdir()
    try:
        with StoreLock(store):  # what fsck holds while it runs: a mount is refused, not blocked
            start = time.monotonic()
            result = run_faultfs("mount", str(mnt), "--store", store, timeout=60)
            assert result.returncode != 0
            assert f"in use by pid {os.getpid()}" in result.stderr
            assert time.monotonic() - start < 30
        assert not os.path.ismount(mnt)
    finally:
        if os.path.ismount(mnt):
            run_faultfs("umount", str(mnt))


# -- without a mount --------------------------------------------------------------------------

def make_store(root: str, tag: str = "big", blobs: int = 4, payload: bytes = b"x" * 100
               ) -> tuple[str, FaultContext]:
    """A store as a mount leaves it: a registry entry, a tag state, ``blobs`` clean blobs."""
    store = BlobStore(root)
    ctx = FaultContext(src="file::/data/big.bin", dst=tag, chunk_size=len(payload))
    Registry(store).put(ctx)
    write_tag_state(store, tag, TagState(key=ctx.key, source_version="100 mtime_ns:5"))
    for i in range(blobs):
        store.put(tag, f"chunk_{i}", payload, flags=FLAG_NO_FAULT, source_version="100 mtime_ns:5")
    return root, ctx


def test_a_tag_whose_directory_name_is_hashed_is_checked_through_its_registry_entry(tmp_path):
    long_tag = "é" * 100  # percent-encoded it is 600 bytes: the directory is h-<sha256>
    root, _ = make_store(str(tmp_path / "store"), tag=long_tag)
    assert any(n.startswith("h-") for n in os.listdir(os.path.join(root, "tags")))
    code, doc = fsck_json(root)
    assert (code, doc["problems"]) == (0, [])
    assert doc["areas"]["blobs"]["ok"] == 4 and doc["areas"]["tag states"]["ok"] == 1


def _journal_of_two_segments(tmp_path) -> tuple[str, str, str]:
    """A store whose journal holds three writes in one segment and one in the next: the
    store, then the two segments."""
    root, _ = make_store(str(tmp_path / "store"))
    directory = os.path.join(root, "writes", "journal")
    journal = Journal(directory)
    list(journal.replay())
    for i in range(3):
        journal.append(KIND_WRITE, "big", "chunk_0", i, 4, b"abcd")
    journal.roll()
    journal.append(KIND_WRITE, "big", "chunk_1", 0, 2, b"zz")
    journal.sync()
    journal.close()
    first, second = (os.path.join(directory, n) for n in sorted(os.listdir(directory)))
    return root, first, second


def test_journal_damage_in_the_middle_is_not_a_torn_tail_and_what_follows_is_not_replayed(
        tmp_path):
    root, first, second = _journal_of_two_segments(tmp_path)
    assert fsck_json(root)[0] == 0
    record = len(encode(Record(1, KIND_WRITE, "big", "chunk_0", 0, 4, b"abcd")))
    flip(first, record + 60)  # a byte of the second record's data
    code, doc = fsck_json(root, "--repair")
    assert code == 1
    reasons = {p["path"]: (p["reason"], p["action"]) for p in doc["problems"]}
    reason, action = reasons[os.path.relpath(first, root)]
    assert f"the record at byte {record} after 1 good records does not verify" in reason
    assert "torn" not in reason and action == "kept"
    reason, action = reasons[os.path.relpath(second, root)]
    assert "not replayed" in reason and action == "kept"

    os.unlink(second)
    zeros = bytes(3 * record)
    flip(first, record + 60)  # repaired: now the first segment ends in zeros a crash left
    with open(first, "ab") as f:
        f.write(zeros)
    code, doc = fsck_json(root)
    [problem] = doc["leftovers"]
    assert code == 0 and doc["problems"] == []
    assert "torn tail" in problem["reason"] and "after 3 good records" in problem["reason"]


def test_a_journal_write_whose_data_does_not_verify_says_what_the_next_mount_keeps(tmp_path):
    """Its head verifies but its data does not: not a torn tail (records follow), so the
    finding says the next mount keeps what follows aside, and the later segment follows it."""
    root, first, second = _journal_of_two_segments(tmp_path)
    record = len(encode(Record(1, KIND_WRITE, "big", "chunk_0", 0, 4, b"abcd")))
    flip(first, 2 * record - 2)  # a byte of the second record's data
    code, doc = fsck_json(root)
    assert code == 1
    reasons = {p["path"]: p["reason"] for p in doc["problems"]}
    reason = reasons[os.path.relpath(first, root)]
    assert "data checksum" in reason and "the next mount keeps them in writes/damaged/" in reason
    assert "keeps it in writes/damaged/" in reasons[os.path.relpath(second, root)]


def test_bad_store_arguments_cannot_run(tmp_path):
    for target in (tmp_path / "absent", tmp_path):
        for cmd in ("fsck", "gc"):
            code, out, err = cli(cmd, str(target))
            assert code == 2 and out == "" and err.startswith(f"faultfs: {cmd}: ")
            assert err.count("\n") == 1


def test_tag_state_and_registry_damage_is_found_and_repaired(tmp_path):
    root, ctx = make_store(str(tmp_path / "store"))
    state = os.path.join(root, "tags", "t-big", "tag.json")
    with open(state, "w") as f:
        f.write("{not json")
    other = FaultContext(src="file::/data/b.bin", dst="b", chunk_size=100)
    Registry(BlobStore(root)).put(other)
    write_tag_state(BlobStore(root), "b", TagState(key=other.key, source_version="1 x"))
    with open(registry_path(root, other.key), "r+b") as f:
        f.truncate(HEADER_LEN + 3)  # the entry registering "b" is damaged: "b" is orphaned
    code, doc = fsck_json(root, "--repair")
    assert code == 1
    assert problems(doc) == {
        "tags/t-big/tag.json": ("damaged", "dropped"),
        os.path.relpath(registry_path(root, other.key), root): ("damaged", "dropped"),
        "tags/t-b/tag.json": ("orphaned", "dropped"),
    }
    assert not os.path.exists(os.path.join(root, "tags", "t-b"))
    code, doc = fsck_json(root)
    assert problems(doc) == {
        os.path.relpath(registry_path(root, ctx.key), root): ("orphaned", ""),
    }, "a registered tag without a state is reported and kept: a mount recovers it"


def test_the_walk_holds_no_name_of_every_blob(tmp_path):
    """Memory is bounded by tags, not blobs: walking 5000 blobs allocates no more at its
    peak than a few of them need (holding every finding would cost over a megabyte)."""
    count = 5000
    root, _ = make_store(str(tmp_path / "store"), blobs=count)
    seen = 0
    tracemalloc.start()
    try:
        for finding in StoreWalk(root, verify=True):
            seen += 1
            if finding.area == BLOBS and seen <= 3:
                tracemalloc.reset_peak()  # from the first blob on: the registry is read
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seen == count + 2  # the blobs, the tag state, the registry entry
    assert peak < 256 << 10, peak


class _Writer(threading.Thread):
    """Writes through a mount until it dies: small and large writes of the view (journal
    records), whole-chunk writes (direct files), new user blobs and writes into them. ``acked`` are
    the ops answered; ``in_flight`` the one the kill caught, if any."""

    def __init__(self, tag: str, seed: int, first_user: int) -> None:
        super().__init__(daemon=True)
        from faultfs.testing.torture.case_crash import CHUNK as CS
        from faultfs.testing.torture.case_crash import SOURCE_SIZE, VIEW

        self.tag, self.view, self.cs, self.size = tag, VIEW, CS, SOURCE_SIZE
        self.rng = random.Random(seed)
        self.next_user = first_user
        self.users: dict[str, int] = {}
        self.acked: list = []
        self.in_flight = None

    def _op(self, n: int):
        from faultfs.testing.torture.writeops import WriteOp

        r, rng = self.rng.random(), self.rng
        if r < 0.40:
            return WriteOp(n, "view", rng.randrange(self.size), rng.randbytes(rng.randrange(1, 16 * KiB)))
        if r < 0.50:  # records of more than 64 KiB: a head, then the data, two writes
            return WriteOp(n, "view", rng.randrange(self.size),
                           rng.randbytes(rng.randrange(64 * KiB, 400 * KiB)))
        if r < 0.70:
            return WriteOp(n, "view", rng.randrange(self.size // self.cs) * self.cs,
                           rng.randbytes(self.cs))
        if r < 0.85 or not self.users:
            self.next_user += 1
            return WriteOp(n, "user_new", 0, rng.randbytes(rng.randrange(1, 16 * KiB)),
                           name=f"u{self.next_user:05d}")
        name = rng.choice(sorted(self.users))
        return WriteOp(n, "user_write", rng.randrange(self.users[name] + 4 * KiB),
                       rng.randbytes(rng.randrange(1, 16 * KiB)), name=name)

    def run(self) -> None:
        n = 0
        while True:
            op = self._op(n)
            self.in_flight = op
            try:
                path = os.path.join(self.tag, op.name or self.view)
                fd = os.open(path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL
                                                  if op.kind == "user_new" else 0), 0o644)
                try:
                    written = os.pwrite(fd, op.data, op.off)
                finally:
                    os.close(fd)
            except OSError:
                return  # the mount died: ``in_flight`` may have landed in part or whole
            assert written == len(op.data)
            if op.name:
                self.users[op.name] = max(self.users.get(op.name, 0), op.off + len(op.data))
            self.acked.append(op)
            self.in_flight = None
            n += 1


@mount
def test_fsck_after_a_kill_9_under_writers_judges_the_store_as_the_mount_does(mounter, tmp_path):
    """kill -9 of a daemon under writers, then fsck, many rounds: fsck called the store
    damaged (exit 1) in a fifth to a quarter of them — the temp file of a fold under way, the
    empty or half-written direct file of a whole-chunk write never answered, a torn journal
    tail — while the next mount replays the journal and serves every acknowledged byte.
    fsck must find each store clean, and the next mount must serve every answered write."""
    from faultfs.testing.torture.case_crash import CHUNK as CS
    from faultfs.testing.torture.case_crash import SOURCE_SIZE, VIEW, _partial_states, verify
    from faultfs.testing.torture.writeops import WriteModel

    rng = random.Random(43)
    source = rng.randbytes(SOURCE_SIZE)
    src = tmp_path / VIEW
    src.write_bytes(source)
    model = WriteModel(bytearray(source), CS)
    legal = [model]
    new_user = None
    store, mnt = str(tmp_path / "store"), str(tmp_path / "mnt")
    verdicts = []
    started = time.monotonic()
    rounds = 0
    while time.monotonic() - started < 18 or rounds < 4:  # ~9 rounds
        rounds += 1
        if rounds == 1:
            m = mounter(str(src), store=store, mountpoint=mnt,
                        args=["--chunk-size", str(CS), "--dirty-mb", "1", "--journal-mb", "1"])
        else:
            m = mounter(store=store, mountpoint=mnt)
            problems = verify(m, legal, new_user)
            assert not problems, (f"round {rounds}: the mount after fsck said "
                                  f"{verdicts[-1]} lost acknowledged writes: {problems[:3]}")
            legal = [_as_read(m, CS)]
        writer = _Writer(m.tag("crash"), rounds, 1000 * rounds)
        writer.start()
        time.sleep(rng.uniform(0.15, 0.6))
        m.crash()
        _wait_ended(m.pid)
        writer.join(10)
        assert not writer.is_alive(), "the writer hangs on the dead mount"
        m.pid = None
        code, doc = fsck_json(store)
        verdicts.append((code, [p["reason"][:120] for p in doc["problems"]][:3]))
        prefix = legal[0]
        for op in writer.acked:
            prefix.apply(op)
        legal = [prefix]
        new_user = None
        if writer.in_flight is not None:
            op = writer.in_flight
            legal.extend(_partial_states(prefix, op))
            new_user = op.name if op.kind == "user_new" else None
    bad = [(i, v) for i, v in enumerate(verdicts, 1) if v[0] != 0]
    assert not bad, f"fsck called {len(bad)} of {rounds} stores damaged after a kill -9: {bad[:8]}"
    m = mounter(store=store, mountpoint=mnt)
    assert not verify(m, legal, new_user)


def _wait_ended(pid: int) -> None:
    """Until process ``pid`` has ended (a zombie has: its parent may reap it late)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not end on SIGKILL")


def _as_read(m, cs: int):
    """What the mount serves, as the model of the next round (``verify`` found every blob of
    it in one of the legal states)."""
    from faultfs.testing.torture.case_crash import VIEW
    from faultfs.testing.torture.writeops import WriteModel

    tag = m.tag("crash")
    users = {n: bytearray(read(os.path.join(tag, n))) for n in os.listdir(tag)
             if not n.startswith("chunk_") and n != VIEW}
    return WriteModel(bytearray(read(os.path.join(tag, VIEW))), cs, users)
