"""Hostile store contents under ``<store>/writes`` and in the registry: a clear error or a
kept, reported problem, never data written outside the store and never a mount that cannot
come up."""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat

import pytest
from conftest import Mount, run_faultfs

pytestmark = pytest.mark.mount
MiB = 1 << 20


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_at(path: str, off: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(off)
        f.write(data)


def _written_store(mounter, sample, *sources):
    srcs = sources or (sample(2 * MiB),)
    m = mounter(*srcs, args=["--chunk-size", "1M"])
    write_at(os.path.join(m.tag("field"), "chunk_1"), 5, b"dirty")
    m.umount()
    return m, srcs


def test_the_writes_directories_are_private(mounter, sample):
    m, _ = _written_store(mounter, sample)
    for sub in ("writes", "writes/journal", "writes/t-field"):
        mode = stat.S_IMODE(os.stat(os.path.join(m.store, sub)).st_mode)
        assert mode == 0o700, f"{sub} is {oct(mode)}"


def test_a_linked_tag_directory_is_never_written_through(mounter, sample, tmp_path):
    m, (src,) = _written_store(mounter, sample)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"not the store's")
    tag_dir = os.path.join(m.store, "writes", "t-field")
    os.rename(tag_dir, str(tmp_path / "moved"))
    os.symlink(outside, tag_dir)
    m2 = mounter(store=m.store)
    view = os.path.join(m2.tag("field"), "field.bin")
    assert read(view) == read(src)  # the link holds no writes: the source's bytes
    write_at(view, 100, b"new")
    run_faultfs("umount", m2.path, check=True)
    assert sorted(os.listdir(outside)) == ["keep.txt"]  # nothing written through the link
    assert not os.path.islink(tag_dir) and os.path.isdir(tag_dir)
    m3 = mounter(store=m.store)
    assert read(os.path.join(m3.tag("field"), "field.bin"))[100:103] == b"new"


def test_a_linked_writes_directory_refuses_the_mount(mounter, sample, tmp_path):
    m, _ = _written_store(mounter, sample)
    writes = os.path.join(m.store, "writes")
    os.rename(writes, str(tmp_path / "elsewhere"))
    os.symlink(tmp_path / "elsewhere", writes)
    mnt = tmp_path / "m"
    mnt.mkdir()
    r = run_faultfs("mount", str(mnt), "--store", m.store)
    assert r.returncode != 0 and "symbolic link" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("foreign", ["fifo", "directory", "symlink"])
def test_a_foreign_entry_where_a_dirty_file_is_reads_as_eio_and_the_rest_serves(
        mounter, sample, tmp_path, foreign):
    m, (src,) = _written_store(mounter, sample)
    path = os.path.join(m.store, "writes", "t-field", "b-chunk_1")
    os.unlink(path)
    if foreign == "fifo":
        os.mkfifo(path)
    elif foreign == "directory":
        os.mkdir(path)
    else:
        os.symlink(src, path)
    m2 = mounter(store=m.store)
    tag = m2.tag("field")
    with pytest.raises(OSError) as exc:
        read(os.path.join(tag, "chunk_1"))
    assert exc.value.errno == errno.EIO  # user data that cannot be read: reported, kept
    assert read(os.path.join(tag, "chunk_0")) == read(src)[:MiB]
    assert os.path.lexists(path)


@pytest.mark.parametrize("damage", ["not-json", "wrong-types", "a-directory"])
def test_a_damaged_write_state_keeps_the_mount_up_and_refuses_writes_to_its_tag(
        mounter, sample, damage):
    a, b = sample(2 * MiB, "field.bin"), sample(MiB, "other.bin", seed=3)
    m, _ = _written_store(mounter, sample, a, b)
    path = os.path.join(m.store, "writes", "t-field", "state.json")
    before = read(path)
    if damage == "not-json":
        with open(path, "wb") as f:
            f.write(b"{ not json")
    elif damage == "wrong-types":
        doc = json.loads(before)
        doc["view_size"], doc["users"] = "big", []
        with open(path, "w") as f:
            json.dump(doc, f)
    else:
        os.unlink(path)
        os.mkdir(path)
    kept = read(path) if damage != "a-directory" else None
    mnt = os.path.join(os.path.dirname(m.store), "mnt-damaged")
    os.mkdir(mnt)
    r = run_faultfs("mount", mnt, "--store", m.store, check=True)
    assert "warning" in r.stderr and "new writes are refused" in r.stderr  # said at mount
    run_faultfs("umount", mnt, check=True)
    m2 = mounter(store=m.store)
    tag = m2.tag("field")
    assert read(os.path.join(tag, "chunk_1"))[5:10] == b"dirty"  # its dirty files still read
    with pytest.raises(OSError) as exc:
        write_at(os.path.join(tag, "chunk_0"), 0, b"x")
    assert exc.value.errno == errno.EIO
    write_at(os.path.join(m2.tag("other"), "chunk_0"), 0, b"fine")  # other tags take writes
    run_faultfs("umount", m2.path, check=True)
    if kept is not None:
        assert read(path) == kept  # never written over
    with open(os.path.join(m.store, "log", "faultfs.log")) as f:
        assert "new writes are refused" in f.read()


def test_a_registry_entry_that_cannot_come_back_does_not_block_the_others(mounter, sample):
    a, b = sample(MiB, "alpha.bin"), sample(MiB, "beta.bin", seed=2)
    m = mounter(a, b)
    read(os.path.join(m.tag("beta"), "beta.bin"))
    m.umount()
    # alpha's state is gone and its source too: it cannot be recovered
    import shutil

    shutil.rmtree(os.path.join(m.store, "tags", "t-alpha"))
    os.unlink(a)
    m2 = mounter(store=m.store)
    assert sorted(os.listdir(m2.path)) == [".faultfs", "beta"]
    assert read(os.path.join(m2.tag("beta"), "beta.bin")) == read(b)
    with open(os.path.join(m.store, "log", "faultfs.log")) as f:
        assert "tag alpha cannot be recovered" in f.read()  # said in the store's log


def test_a_spilled_write_whose_journal_bytes_changed_reads_eio_never_other_bytes(mounter,
                                                                                sample):
    """Past ``--dirty-mb`` a write's bytes are read back from the journal: when those bytes
    on disk no longer verify (changed under the mount), reads of them fail with EIO — never
    zeros or the changed bytes — and the rest of the view still reads."""
    src = sample(4 * MiB)
    m = mounter(src, args=["--chunk-size", "1M", "--dirty-mb", "1"])
    view = os.path.join(m.tag("field"), "field.bin")
    marker = b"\xa5" * 4096
    with open(view, "r+b") as f:
        f.seek(3 * MiB)
        f.write(marker)
        f.flush()
        for i in range(400):  # 1.6 MiB more: past the memory bound, the marker is spilled
            f.seek(i * 4096)
            f.write(bytes([i % 251 + 1]) * 4096)
    assert m.counters()["spills"] >= 1
    journal = os.path.join(m.store, "writes", "journal")
    [segment] = os.listdir(journal)
    raw = read(os.path.join(journal, segment))
    at = raw.index(marker)
    write_at(os.path.join(journal, segment), at + 10, b"\x00")
    fd = os.open(view, os.O_RDONLY | os.O_DIRECT)  # around the kernel's cache of the view
    try:
        buf = mmap.mmap(-1, 4096)
        with pytest.raises(OSError) as err:
            os.preadv(fd, [buf], 3 * MiB)
        assert err.value.errno == errno.EIO
        assert os.preadv(fd, [buf], 2 * MiB) == 4096 and bytes(buf) == read(src)[2 * MiB:2 * MiB + 4096]
    finally:
        os.close(fd)
    with pytest.raises(OSError) as err:  # the blob is kept as it is: not written over
        write_at(view, 3 * MiB + 8192, b"over")
    assert err.value.errno == errno.EIO


def _direct_read(path: str, off: int, size: int = 4096) -> bytes:
    """``size`` bytes at ``off`` around the kernel's cache of the file (a fresh answer)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, size)
        got = os.preadv(fd, [buf], off)
        return bytes(buf[:got])
    finally:
        os.close(fd)


def _corrupt_in_journal(store: str, needle: bytes) -> None:
    journal = os.path.join(store, "writes", "journal")
    for segment in sorted(os.listdir(journal)):
        raw = read(os.path.join(journal, segment))
        if needle in raw:
            write_at(os.path.join(journal, segment), raw.index(needle) + 10, b"\x00")
            return
    raise AssertionError("the bytes are not in the journal")


@pytest.mark.parametrize("end", ["umount", "kill"])
def test_a_blob_whose_spilled_write_is_damaged_stays_damaged_and_the_journal_lets_go(
        mounter, sample, end):
    """A damaged spilled write makes its blob damaged for good — EIO across remounts (also
    when the daemon is killed right after: the damage is saved when found), never its older
    bytes — without holding up the others: the unmount folds every other blob and lets the
    journal go (the segments with the damaged blob's records are kept in
    ``writes/damaged/``, which fsck lists), the writes after it read back, a clone of the
    tag is refused, and ``faultfs reset`` of that blob brings the source's bytes back."""
    src = sample(4 * MiB)
    source = read(src)
    m = mounter(src, args=["--chunk-size", "1M", "--dirty-mb", "1"])
    view = os.path.join(m.tag("field"), "field.bin")
    want = bytearray(source)
    marker = b"\xa5" * 4096
    fd = os.open(view, os.O_WRONLY)
    try:
        os.pwrite(fd, marker, 3 * MiB)
        for i in range(400):  # 1.6 MiB more: past the memory bound, the marker is spilled
            data = bytes([i % 251 + 1]) * 4096
            os.pwrite(fd, data, i * 4096)
            want[i * 4096:(i + 1) * 4096] = data
    finally:
        os.close(fd)
    assert m.counters()["spills"] >= 1
    _corrupt_in_journal(m.store, marker)
    with pytest.raises(OSError) as err:
        _direct_read(view, 3 * MiB)
    assert err.value.errno == errno.EIO
    write_at(view, 2 * MiB + 5, b"after the damage")  # the others still take writes
    want[2 * MiB + 5:2 * MiB + 21] = b"after the damage"
    r = run_faultfs("clone", m.tag("field"), "snap")
    assert r.returncode != 0 and "chunk_3" in r.stderr and len(r.stderr.splitlines()) == 1
    assert not os.path.exists(m.tag("snap"))
    if end == "kill":
        with open(view, "r+b") as f:
            os.fsync(f.fileno())
        m.crash()
        assert m.wait_gone()
        again = mounter(store=m.store, mountpoint=m.path)
        with pytest.raises(OSError) as err:
            _direct_read(os.path.join(again.tag("field"), "chunk_3"), 0)
        assert err.value.errno == errno.EIO
        assert _direct_read(os.path.join(again.tag("field"), "field.bin"), 0, 3 * MiB) == bytes(
            want[:3 * MiB])
        again.umount()
    else:
        m.umount()  # every other blob folded, the journal let go
    writes = os.path.join(m.store, "writes")
    kept = os.listdir(os.path.join(writes, "damaged"))
    assert kept and any(marker[:10] in read(os.path.join(writes, "damaged", k)) for k in kept)
    assert sum(os.path.getsize(os.path.join(writes, "journal", s))
               for s in os.listdir(os.path.join(writes, "journal"))) == 0
    state = json.loads(read(os.path.join(writes, "t-field", "state.json")))
    assert list(state["damaged_blobs"]) == ["chunk_3"]
    doc = json.loads(run_faultfs("fsck", m.store, "--json").stdout)
    said = [f["reason"] for f in doc["problems"]]
    assert any("chunk_3" in d and "faultfs reset" in d for d in said), said
    assert any("kept by a mount" in d for d in said), said

    m2 = mounter(store=m.store, mountpoint=m.path)
    tag = m2.tag("field")
    view = os.path.join(tag, "field.bin")
    with pytest.raises(OSError) as err:  # still damaged: never the chunk's older bytes
        _direct_read(os.path.join(tag, "chunk_3"), 0)
    assert err.value.errno == errno.EIO
    assert m2.stats()["tags"]["field"]["damaged_blobs"] == ["chunk_3"]
    shown = run_faultfs("stat", m2.path, check=True).stdout
    assert "damaged (EIO until `faultfs reset`): chunk_3" in shown, shown
    assert _direct_read(view, 0, 3 * MiB) == bytes(want[:3 * MiB])  # everyone else's writes
    run_faultfs("reset", tag, "chunk_3", check=True)
    assert _direct_read(view, 0, 4 * MiB) == bytes(want[:3 * MiB]) + source[3 * MiB:]
    m2.umount()
    assert "damaged_blobs" not in json.loads(read(os.path.join(writes, "t-field", "state.json")))
    m3 = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(m3.tag("field"), "field.bin")) == bytes(want[:3 * MiB]) + source[3 * MiB:]


def _written_then_killed(mounter, sample, writes: list[tuple[int, bytes]]):
    """A 4 MiB view in 1 MiB chunks, ``writes`` (offset, bytes) made and fsynced, then the
    daemon killed -9: ``(mount, source bytes)``."""
    src = sample(4 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    fd = os.open(os.path.join(m.tag("field"), "field.bin"), os.O_WRONLY)
    try:
        for off, data in writes:
            os.pwrite(fd, data, off)
        os.fsync(fd)
    finally:
        os.close(fd)
    m.crash()
    assert m.wait_gone()
    return m, read(src)


def _remount(m) -> tuple[str, Mount]:
    """Mount ``m``'s store again where it was: what the mount said, and the mount."""
    r = run_faultfs("mount", m.path, "--store", m.store, "--reserve-mb", "0")
    assert r.returncode == 0, r.stderr
    return r.stderr, Mount(m.path, m.store)


def test_a_write_damaged_in_the_journal_after_a_kill_ends_the_replay_and_keeps_the_rest(
        mounter, sample):
    """The replay after a kill -9 meets a write whose data no longer verifies: it cannot tell
    that from a power loss's lost page, so it stops there as at a torn record — every blob at
    a prefix of its writes, none made unreadable — but the records after it, which verify,
    are kept in ``writes/damaged/`` and the mount says so, never deleted."""
    marker = b"\x5a" * 8192
    m, source = _written_then_killed(mounter, sample, [
        (MiB + 100, marker), (2 * MiB, b"written later"), (10, b"and last")])
    _corrupt_in_journal(m.store, marker[:2000])  # (the kernel may cut the write by pages)
    said, m2 = _remount(m)
    try:
        assert "not replayed" in said and "writes/damaged" in said, said
        tag = m2.tag("field")
        assert _direct_read(os.path.join(tag, "chunk_2"), 0, 13) == source[2 * MiB:2 * MiB + 13]
        kept = os.path.join(m.store, "writes", "damaged")
        held = b"".join(read(os.path.join(kept, k)) for k in os.listdir(kept))
        assert b"written later" in held and b"and last" in held
        write_at(os.path.join(tag, "field.bin"), 2 * MiB, b"new")  # seqs go on past the kept
    finally:
        m2.close()
    m3 = mounter(store=m.store, mountpoint=m.path)
    assert _direct_read(os.path.join(m3.tag("field"), "chunk_2"), 0, 3) == b"new"


def test_a_damaged_record_head_sets_the_rest_of_the_journal_aside_never_deletes_it(
        mounter, sample):
    """A record whose head no longer verifies ends the replay (where the next one starts is
    not known): what follows it is moved to ``writes/damaged/`` — never deleted — and the
    mount says so; the writes before it replay."""
    m, source = _written_then_killed(mounter, sample, [
        (0, b"first"), (MiB, b"second-write"), (2 * MiB, b"third")])
    journal = os.path.join(m.store, "writes", "journal")
    [segment] = [s for s in os.listdir(journal) if os.path.getsize(os.path.join(journal, s))]
    raw = read(os.path.join(journal, segment))
    head = raw.rindex(b"FFSWAL", 0, raw.index(b"second-write"))
    write_at(os.path.join(journal, segment), head + 20, b"\xff")  # its name's length
    said, m2 = _remount(m)
    try:
        assert "not replayed" in said and "writes/damaged" in said, said
        tag = m2.tag("field")
        assert _direct_read(os.path.join(tag, "chunk_0"), 0, 5) == b"first"
        assert _direct_read(os.path.join(tag, "chunk_2"), 0, 5) == source[2 * MiB:2 * MiB + 5]
        [kept] = os.listdir(os.path.join(m.store, "writes", "damaged"))
        assert read(os.path.join(m.store, "writes", "damaged", kept)).count(b"third") == 1
    finally:
        m2.close()



def test_a_journal_segment_replaced_by_a_link_refuses_the_mount_and_its_target_is_untouched(
        mounter, sample, tmp_path):
    """Every file the daemon opens in the store refuses to follow a link: a journal segment
    replaced by one after a kill -9 had the daemon (root) cut its target to nothing at the
    next mount and append journal records to it."""
    m, _ = _written_then_killed(mounter, sample, [(MiB + 100, b"dirty")])
    victim = tmp_path / "victim"
    victim.write_bytes(b"not the store's " * 1000)
    journal = os.path.join(m.store, "writes", "journal")
    path = os.path.join(journal, sorted(os.listdir(journal))[-1])
    os.unlink(path)
    os.symlink(victim, path)
    r = run_faultfs("mount", m.path, "--store", m.store, "--reserve-mb", "0")
    if r.returncode == 0:
        m2 = Mount(m.path, m.store)
        try:
            write_at(os.path.join(m2.tag("field"), "field.bin"), 3 * MiB, b"written after")
            m2.umount()
        finally:
            m2.close()
    assert read(victim) == b"not the store's " * 1000, "the link's target was written"
    assert r.returncode != 0 and "symbolic link" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.path.islink(path), "the link was not kept for the user to look at"
    doc = json.loads(run_faultfs("fsck", m.store, "--json").stdout)
    assert any(os.path.basename(path) in p["path"] for p in doc["problems"]), doc["problems"]
