"""Ownership on mounts: ``--uid``, ``--gid``, ``--file-mode``, ``--dir-mode``, ``--umask`` (and
``-o uid=…,gid=…,umask=…``) honoured for every entry; the kernel checks them; ``--allow-other``
still decides who gets in at all. The arithmetic is pure (core/ownership.py); the rest runs
against real mounts, as other users (setuid children)."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import pytest
from conftest import run_faultfs

from faultfs.cli.fstab import mount_argv
from faultfs.core.ownership import Ownership, parse_mode
from faultfs.errors import InvalidInput

OWNER, GROUP, STRANGER = 4242, 4243, 4244

# --- pure ---


def test_modes_for_directories_files_and_read_only_files():
    owner = Ownership(OWNER, GROUP, 0o640, 0o750)
    assert owner.mode(stat.S_IFDIR | 0o755) == stat.S_IFDIR | 0o750
    assert owner.mode(stat.S_IFREG | 0o644) == stat.S_IFREG | 0o640
    assert owner.mode(stat.S_IFREG | 0o444) == stat.S_IFREG | 0o440  # never promises a write
    # a mode someone chose (a blob created 0600, a chmod) is its own: private stays private
    assert owner.mode(stat.S_IFREG | 0o600) == stat.S_IFREG | 0o600
    assert owner.mode(stat.S_IFDIR | 0o700) == stat.S_IFDIR | 0o700
    unset = Ownership(OWNER, GROUP)
    assert unset.mode(stat.S_IFREG | 0o444) == stat.S_IFREG | 0o444
    assert unset.mode(stat.S_IFDIR | 0o755) == stat.S_IFDIR | 0o755
    masked = Ownership.with_umask(1, 2, 0o027)
    assert (masked.file_mode, masked.dir_mode) == (0o640, 0o750)
    assert Ownership.with_umask(1, 2, 0o077, file_mode=0o644).file_mode == 0o644


@pytest.mark.parametrize("bad", ["", "9", "0o8", "12345", "-1", "rw-r--r--"])
def test_bad_modes_refused(bad):
    with pytest.raises(InvalidInput):
        parse_mode(bad, "file mode")


def test_bad_owners_refused():
    with pytest.raises(InvalidInput):
        Ownership(-1, 0)
    with pytest.raises(InvalidInput):
        Ownership(0, 1 << 32)
    with pytest.raises(InvalidInput):
        Ownership.with_umask(0, 0, 0o1000)


def test_fstab_options_become_flags():
    argv = mount_argv(["/data/f.bin", "/mnt/f", "-o",
                       "store=/s,uid=1000,gid=100,umask=022,file_mode=0640,dir_mode=0750,nofail"])
    assert argv == ["mount", "/data/f.bin", "/mnt/f", "--store", "/s", "--uid", "1000",
                    "--gid", "100", "--umask", "022", "--file-mode", "0640",
                    "--dir-mode", "0750"]


@pytest.mark.parametrize(("flags", "words"), [
    (["--uid", "no-such-user-here"], "no user"),
    (["--gid", "4294967296"], "not in"),
    (["--file-mode", "0999"], "octal"),
    (["--umask", "abc"], "octal"),
])
def test_bad_flags_refused_in_one_line(tmp_path, sample, flags, words):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = run_faultfs("mount", sample(4096), str(mnt), "--store", str(tmp_path / "store"),
                         *flags)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0]
    assert not (tmp_path / "store").exists()


# --- real mounts ---

AS_USER = r"""
import os, sys, json
uid, gid, path, op = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
try:
    if op == "read":
        with open(path, "rb") as f:
            f.read(10)
    elif op == "list":
        os.listdir(path)
    elif op == "write":
        with open(path, "r+b") as f:
            f.write(b"x")
    print("ok")
except OSError as exc:
    print(exc.errno)
"""


@pytest.fixture
def open_mnt():
    """A mountpoint other users can reach (pytest's own directories are 0700)."""
    import shutil
    import tempfile

    made = []

    def make() -> str:
        path = tempfile.mkdtemp(prefix="faultfs-own-", dir="/tmp")
        os.chmod(path, 0o755)
        made.append(path)
        return os.path.join(path, "mnt")

    yield make
    for path in made:
        if not os.path.ismount(os.path.join(path, "mnt")):  # the mounts went first
            shutil.rmtree(path, ignore_errors=True)


def as_user(uid: int, gid: int, path: str, op: str) -> str:
    out = subprocess.run([sys.executable, "-c", AS_USER, str(uid), str(gid), path, op],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.mount
def test_every_entry_answers_with_the_owner_and_modes(open_mnt, mounter, sample):
    src = sample(3 << 20, "field.bin")
    mnt = mounter(src, mountpoint=open_mnt(), args=["--allow-other", "--uid", str(OWNER), "--gid", str(GROUP),
                             "--file-mode", "0640", "--dir-mode", "0750", "--page-size", "1M",
                             "--chunk-size", "1M"])
    root = mnt.path
    with open(os.path.join(root, "field", "mine.txt"), "wb") as f:  # a user blob
        f.write(b"hello")
    os.chmod(os.path.join(root, "field", "mine.txt"), 0o644)  # the default bits
    fd = os.open(os.path.join(root, "field", "private.txt"), os.O_CREAT | os.O_WRONLY, 0o600)
    os.close(fd)
    entries = {
        "root": (root, 0o750, stat.S_IFDIR), "tag": (f"{root}/field", 0o750, stat.S_IFDIR),
        "chunk": (f"{root}/field/chunk_1", 0o640, stat.S_IFREG),
        "view": (f"{root}/field/field.bin", 0o640, stat.S_IFREG),
        "page": (f"{root}/field/page:0", 0o640, stat.S_IFREG),
        "pagemap": (f"{root}/field/.pagemap", 0o640, stat.S_IFREG),
        "user blob": (f"{root}/field/mine.txt", 0o640, stat.S_IFREG),
        "control dir": (f"{root}/.faultfs", 0o750, stat.S_IFDIR),
        "stats": (f"{root}/.faultfs/stats", 0o440, stat.S_IFREG),  # never writable
        "private blob": (f"{root}/field/private.txt", 0o600, stat.S_IFREG),  # its own mode
    }
    for what, (path, mode, kind) in entries.items():
        st = os.stat(path)
        assert (st.st_uid, st.st_gid) == (OWNER, GROUP), what
        assert stat.S_IFMT(st.st_mode) == kind and stat.S_IMODE(st.st_mode) == mode, what
    listed = {e.name: e.stat().st_uid for e in os.scandir(f"{root}/field")}
    assert set(listed.values()) == {OWNER}
    chunk = f"{root}/field/chunk_1"
    assert as_user(OWNER, GROUP, chunk, "read") == "ok"
    assert as_user(OWNER, GROUP, chunk, "write") == "ok"
    assert as_user(STRANGER, GROUP, chunk, "read") == "ok"  # the group may read ...
    assert as_user(STRANGER, GROUP, chunk, "write") == str(errno.EACCES)  # ... not write
    assert as_user(STRANGER, STRANGER, f"{root}/field", "list") == str(errno.EACCES)
    assert as_user(STRANGER, STRANGER, chunk, "read") == str(errno.EACCES)
    assert as_user(STRANGER, GROUP, f"{root}/field/private.txt", "read") == str(errno.EACCES)
    os.chown(chunk, OWNER, GROUP)  # to what it shows: nothing changes, fine
    with pytest.raises(PermissionError):
        os.chown(chunk, STRANGER, GROUP)


@pytest.mark.mount
def test_without_allow_other_the_owner_is_still_kept_out(open_mnt, mounter, sample):
    mnt = mounter(sample(1 << 20), mountpoint=open_mnt(), args=["--uid", str(OWNER), "--gid", str(GROUP),
                                         "--umask", "0"])
    tag = os.path.join(mnt.path, os.listdir(mnt.path)[0])
    assert os.stat(tag).st_uid == OWNER and stat.S_IMODE(os.stat(tag).st_mode) == 0o777
    assert as_user(OWNER, GROUP, tag, "list") == str(errno.EACCES)


@pytest.mark.mount
def test_read_only_mounts_never_show_write_bits(open_mnt, mounter, sample):
    mnt = mounter(sample(1 << 20, "f.bin"), mountpoint=open_mnt(), args=["--read-only", "--file-mode", "0666",
                                                  "--allow-other"])
    st = os.stat(os.path.join(mnt.path, "f", "chunk_0"))
    assert stat.S_IMODE(st.st_mode) == 0o444 and st.st_uid == os.getuid()
    assert as_user(STRANGER, STRANGER, os.path.join(mnt.path, "f", "chunk_0"), "read") == "ok"
    assert as_user(STRANGER, STRANGER, os.path.join(mnt.path, "f", "chunk_0"),
                   "write") == str(errno.EACCES)
