"""Defects found by trying the mount as a hostile (or merely unlucky) user would: each test
failed before its fix. Real mounts through the CLI."""

from __future__ import annotations

import os
import subprocess

import pytest

pytestmark = pytest.mark.mount

KiB, MiB = 1 << 10, 1 << 20


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def run(*cmd: str, cwd=None) -> None:
    result = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, f"{' '.join(cmd)}: {result.stderr}"


def test_unread_data_is_never_taken_for_a_hole(mounter, sample, tmp_path):
    """A file with data and zero blocks is one whole hole to GNU tar -S, bsdtar and
    cp --sparse: they archived zeros without reading a byte and exited 0."""
    src = sample(5 * MiB + 1000)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    tag = m.tag("field")
    for i in range(5):
        st = os.stat(os.path.join(tag, f"chunk_{i}"))
        assert st.st_size == MiB and st.st_blocks >= 1, "an unstaged chunk still has a block"
        assert os.getxattr(os.path.join(tag, f"chunk_{i}"), "user.faultfs.staged") == b"0"
    out = tmp_path / "out"
    out.mkdir()
    run("tar", "-S", "-cf", str(tmp_path / "gnu.tar"), "-C", tag, "chunk_0")
    run("tar", "-xf", str(tmp_path / "gnu.tar"), "-C", str(out))
    assert read(out / "chunk_0") == data[:MiB], "GNU tar -S archived zeros"
    run("bsdtar", "-cf", str(tmp_path / "bsd.tar"), "-C", tag, "chunk_1")
    run("bsdtar", "-xf", str(tmp_path / "bsd.tar"), "-C", str(out))
    assert read(out / "chunk_1") == data[MiB:2 * MiB], "bsdtar archived zeros"
    run("cp", "--sparse=always", os.path.join(tag, "chunk_2"), str(out / "cp2"))
    assert read(out / "cp2") == data[2 * MiB:3 * MiB], "cp --sparse=always copied zeros"
    run("rsync", "-S", os.path.join(tag, "chunk_3"), str(out / "rs3"))
    assert read(out / "rs3") == data[3 * MiB:4 * MiB], "rsync -S copied zeros"
    assert os.getxattr(os.path.join(tag, "chunk_0"), "user.faultfs.staged") == b"1"
    run("tar", "-S", "-cf", str(tmp_path / "view.tar"), "-C", tag, "field.bin")
    run("tar", "-xf", str(tmp_path / "view.tar"), "-C", str(out))
    assert read(out / "field.bin") == data, "the partly staged view archived with holes"
    du = os.stat(os.path.join(tag, "field.bin")).st_blocks * 512
    assert du >= 5 * MiB, "du still shows what was staged"


def test_a_source_rewritten_with_its_mtime_restored_never_mixes_versions(mounter, sample, tmp_path):
    from conftest import run_faultfs

    src = sample(4 * MiB)
    old = read(src)
    m = mounter(src, args=["--chunk-size", "1M", "--prefetch-mb", "0"])
    view = os.path.join(m.tag("field"), "field.bin")
    with open(view, "rb") as f:
        assert f.read(MiB) == old[:MiB]
    st = os.stat(src)
    new = bytes(b ^ 0xA5 for b in old)
    with open(src, "r+b") as f:
        f.write(new)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))
    fd = os.open(view, os.O_RDONLY)
    try:  # never served: it would be new bytes beside old staged ones
        with pytest.raises(OSError) as info:
            os.pread(fd, MiB, 2 * MiB)
    finally:
        os.close(fd)
    assert info.value.errno == 5
    out = run_faultfs("stat", m.path).stdout
    assert "source changed under the mount" in out
    m.umount()
    m2 = mounter(store=m.store)
    assert read(os.path.join(m2.tag("field"), "field.bin")) == new
    assert m2.stats()["tags"]["field"]["source_changed_at_mount"]


def test_a_fifo_in_the_store_neither_freezes_the_mount_nor_fails_reads(mounter, sample, tmp_path):
    from conftest import run_faultfs

    src = sample(3 * MiB)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    assert read(os.path.join(m.tag("field"), "field.bin")) == data
    m.umount()
    blob = os.path.join(m.store, "tags", "t-field", "b-chunk_1")
    os.unlink(blob)
    os.mkfifo(blob)
    m2 = mounter(store=m.store)
    got = subprocess.run(["cat", os.path.join(m2.tag("field"), "field.bin")],
                         capture_output=True, timeout=30).stdout
    assert got == data
    assert os.path.isfile(blob)
    fifo = tmp_path / "cp.meta"
    os.mkfifo(fifo)
    shown = run_faultfs("checkpoint", "show", str(fifo), timeout=30)
    assert shown.returncode == 1 and "not a regular file, not a checkpoint file" in shown.stderr
    shown = run_faultfs("checkpoint", "show", str(tmp_path), timeout=30)
    assert shown.returncode == 1 and "is a directory, not a checkpoint file" in shown.stderr


def test_a_fifo_as_the_source_is_refused_at_once(tmp_path):
    from conftest import run_faultfs

    fifo = tmp_path / "data.bin"
    os.mkfifo(fifo)
    (tmp_path / "mnt").mkdir()
    result = run_faultfs("mount", str(fifo), str(tmp_path / "mnt"), "--store",
                         str(tmp_path / "store"), timeout=60)
    assert result.returncode == 1
    assert "is not a regular file (a FIFO)" in result.stderr
    assert not os.path.ismount(tmp_path / "mnt")
