"""What the names of a tag do under the calls that change names and sizes, through real
mounts: renameat2's flags on user blobs (and on the names the mount shows), and O_TRUNC on
the fixed-size names."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import time

import pytest

pytestmark = pytest.mark.mount

KiB = 1 << 10
RENAME_NOREPLACE, RENAME_EXCHANGE, RENAME_WHITEOUT = 1, 2, 4  # linux/fs.h
AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                            ctypes.c_uint]


def renameat2(old: str, new: str, flags: int) -> None:
    if _libc.renameat2(AT_FDCWD, os.fsencode(old), AT_FDCWD, os.fsencode(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old)


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def errno_of(fn, *args) -> int:
    with pytest.raises(OSError) as info:
        fn(*args)
    return info.value.errno


def shown(tag: str, names=("a", "b", "c")) -> dict[str, bytes | None]:
    """Each name's bytes (None: absent), checked against its size."""
    out: dict[str, bytes | None] = {}
    for name in names:
        path = os.path.join(tag, name)
        if not os.path.exists(path):
            out[name] = None
            continue
        data = read(path)
        assert os.stat(path).st_size == len(data), name
        out[name] = data
    return out


def killed(m) -> None:
    """kill -9 the daemon of ``m`` and wait until it is gone."""
    m.crash()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{m.pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    m.pid = None


def test_rename_exchange_swaps_two_user_blobs_and_the_swap_survives_remounts_and_kill_9(
        mounter, sample):
    m = mounter(sample(100 * KiB))
    tag = m.tag("field")
    a_bytes, b_bytes = b"A" * 5000, b"bee" * 7
    write(os.path.join(tag, "a"), a_bytes)
    write(os.path.join(tag, "b"), b_bytes)
    held = os.open(os.path.join(tag, "a"), os.O_RDONLY)
    try:
        renameat2(os.path.join(tag, "a"), os.path.join(tag, "b"), RENAME_EXCHANGE)
        assert shown(tag) == {"a": b_bytes, "b": a_bytes, "c": None}
        assert os.pread(held, 10000, 0) == a_bytes, "an open file follows its blob"
    finally:
        os.close(held)
    assert sorted(n for n in os.listdir(tag) if n in "abc") == ["a", "b"]
    m.umount()
    m2 = mounter(store=m.store, mountpoint=m.path)
    tag = m2.tag("field")
    assert shown(tag) == {"a": b_bytes, "b": a_bytes, "c": None}
    renameat2(os.path.join(tag, "b"), os.path.join(tag, "a"), RENAME_EXCHANGE)  # back
    assert shown(tag) == {"a": a_bytes, "b": b_bytes, "c": None}
    killed(m2)
    m3 = mounter(store=m.store, mountpoint=m.path)
    assert shown(m3.tag("field")) == {"a": a_bytes, "b": b_bytes, "c": None}


def test_rename_flags_that_cannot_be_honoured_are_refused_and_change_nothing(mounter, sample):
    m = mounter(sample(100 * KiB), args=["--chunk-size", "16K"])
    tag = m.tag("field")
    write(os.path.join(tag, "a"), b"aaa")
    write(os.path.join(tag, "b"), b"bbbbbb")
    before = shown(tag)
    chunk = read(os.path.join(tag, "chunk_0"))

    def path(name: str) -> str:
        return os.path.join(tag, name)

    # RENAME_NOREPLACE onto anything that exists: EEXIST
    for target in ("b", "chunk_0", "field.bin"):
        assert errno_of(renameat2, path("a"), path(target), RENAME_NOREPLACE) == errno.EEXIST
    # RENAME_EXCHANGE needs both names; one the mount shows is never moved
    assert errno_of(renameat2, path("a"), path("c"), RENAME_EXCHANGE) == errno.ENOENT
    assert errno_of(renameat2, path("c"), path("a"), RENAME_EXCHANGE) == errno.ENOENT
    for fixed in ("chunk_0", "field.bin"):
        assert errno_of(renameat2, path("a"), path(fixed), RENAME_EXCHANGE) == errno.EPERM
        assert errno_of(renameat2, path(fixed), path("a"), RENAME_EXCHANGE) == errno.EPERM
    # both flags, and RENAME_WHITEOUT: EINVAL
    assert errno_of(renameat2, path("a"), path("b"),
                    RENAME_NOREPLACE | RENAME_EXCHANGE) == errno.EINVAL
    assert errno_of(renameat2, path("a"), path("c"), RENAME_WHITEOUT) == errno.EINVAL
    assert shown(tag) == before
    assert read(os.path.join(tag, "chunk_0")) == chunk
    # RENAME_NOREPLACE onto a free name renames
    renameat2(path("a"), path("c"), RENAME_NOREPLACE)
    assert shown(tag) == {"a": None, "b": b"bbbbbb", "c": b"aaa"}
    m.umount()
    assert shown(mounter(store=m.store).tag("field")) == {"a": None, "b": b"bbbbbb",
                                                          "c": b"aaa"}


def test_o_trunc_of_a_chunk_or_a_page_is_refused_and_changes_nothing(mounter, sample):
    """A fixed-size name opened with O_TRUNC fails as truncate(2) of it does (EPERM), with
    any access mode; the shell's ``>`` on a chunk fails and the chunk keeps its bytes."""
    src = sample(128 * KiB)
    m = mounter(src, args=["--chunk-size", "16K", "--page-size", "16K"])
    tag = m.tag("field")
    want = read(src)
    for name, off in (("chunk_7", 7 * 16 * KiB), ("page:3", 3 * 16 * KiB)):
        path = os.path.join(tag, name)
        before = want[off:off + 16 * KiB]
        assert read(path) == before
        done = subprocess.run(["sh", "-c", 'printf hello > "$1"', "sh", path],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode != 0, f"printf hello > {name} succeeded"
        assert "not permitted" in done.stderr, done.stderr
        for mode in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY):
            assert errno_of(os.open, path, mode | os.O_TRUNC) == errno.EPERM, (name, mode)
        assert read(path) == before and os.stat(path).st_size == 16 * KiB, name
    assert read(os.path.join(tag, "field.bin")) == want
    assert m.counters()["writes"] == 0


def test_o_trunc_empties_the_view_and_a_user_blob_with_any_access_mode(mounter, sample):
    """As on a local file system (Linux truncates on O_RDONLY|O_TRUNC too)."""
    src = sample(64 * KiB)
    m = mounter(src, args=["--chunk-size", "16K"])
    tag = m.tag("field")
    write(os.path.join(tag, "notes"), b"some notes")
    for name in ("field.bin", "notes"):
        path = os.path.join(tag, name)
        os.close(os.open(path, os.O_RDONLY | os.O_TRUNC))
        assert os.stat(path).st_size == 0 and read(path) == b"", name
    subprocess.run(["sh", "-c", 'printf hello > "$1"', "sh", os.path.join(tag, "field.bin")],
                   check=True, timeout=30)
    assert read(os.path.join(tag, "field.bin")) == b"hello"
