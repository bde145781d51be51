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
from conftest import run_faultfs

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
