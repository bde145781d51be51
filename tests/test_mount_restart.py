"""A mount outlives its daemon (fuse/holder.py, DESIGN §16): kill -9 of the daemon, or
``faultfs restart``, under open files, readers and writers, and no call fails; the crash sweep
kills the daemon after it read each kind of request and before it answered it, and the caller
gets the answer once; a daemon that keeps crashing is given up; a holder killed leaves today's
behaviour. Every call into a mount whose daemon may be gone runs with a deadline, and a test
that misses one aborts the connection, so nothing here can hang the suite."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, run_faultfs

from faultfs.fuse import connection
from faultfs.fuse.tuning import connection_limits


@pytest.fixture(autouse=True)
def _standby(monkeypatch):
    """The standby daemon a holder preloads (off elsewhere in the suite, tests/conftest.py)."""
    monkeypatch.setenv("FAULTFS_STANDBY", "1")



def _kernel() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except ValueError:
        return (0, 0)


pytestmark = [
    pytest.mark.mount,
    pytest.mark.skipif(_kernel() < (6, 9), reason="a daemon taking a mount over needs the "
                       "kernel to resend what the dead one read (FUSE_NOTIFY_RESEND, Linux "
                       f">= 6.9); this is {os.uname().release}: a crash ends the mount"),
]

KiB, MiB = 1 << 10, 1 << 20
DEADLINE_S = 60.0  # a call into the mount that has not returned by then hangs
DEAD = (errno.ENOTCONN, errno.ECONNABORTED)  # a mount nobody serves (aborted: the latter)


def within(m, fn, *args):
    """``fn(*args)`` in a thread; past DEADLINE_S the mount's connection is aborted and the
    test fails (a call into a FUSE mount cannot be interrupted otherwise)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(DEADLINE_S)
    if t.is_alive():
        entry = connection.find_mount(m.path)
        if entry is not None:
            connection.abort(entry.minor)
        pytest.fail(f"{fn.__name__} did not return within {DEADLINE_S:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def stats(m) -> dict:
    return within(m, lambda: json.loads(read(os.path.join(m.path, ".faultfs", "stats"))))


def kill_daemon(m) -> int:
    """kill -9 the daemon serving ``m``; returns its pid."""
    pid = stats(m)["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def served_again(m, old_pid: int) -> dict:
    """The stats of the daemon that took ``m`` over from ``old_pid``."""
    snap = stats(m)
    assert snap["pid"] != old_pid
    m.pid = snap["pid"]
    return snap


def test_kill_9_under_an_open_reader_and_an_fsyncing_writer_fails_no_call(mounter, sample):
    src = sample(8 * MiB)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M", "--max-background", "40"])
    tag = m.tag("field")
    view = os.open(os.path.join(tag, "field.bin"), os.O_RDONLY)
    blob = os.open(os.path.join(tag, "notes.bin"), os.O_RDWR | os.O_CREAT, 0o600)
    want = bytearray()
    try:
        assert os.pread(view, 4096, 0) == data[:4096]
        for round_ in range(3):
            piece = bytes([round_ + 1]) * (64 * KiB)
            assert os.pwrite(blob, piece, len(want)) == len(piece)
            want += piece
            os.fsync(blob)
            old = kill_daemon(m)
            off = (round_ * 3 + 1) * MiB + 123
            os.posix_fadvise(view, 0, 0, os.POSIX_FADV_DONTNEED)  # not the page cache: the daemon
            assert within(m, os.pread, view, 64 * KiB, off) == data[off:off + 64 * KiB]
            assert within(m, os.pread, blob, len(want), 0) == bytes(want)
            snap = served_again(m, old)
            assert snap["daemon"]["takeovers"] == round_ + 1 and snap["daemon"]["holder"]
            assert os.path.ismount(m.path)
            minor = connection.find_mount(m.path).minor
            assert connection_limits(minor) == {"max_background": 40, "congestion_threshold": 30}
    finally:
        os.close(view)
        os.close(blob)
    r = run_faultfs("stat", m.path)
    assert "taken over 3 time(s)" in r.stdout, r.stdout
    m.umount()
    again = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(again.tag("field"), "notes.bin")) == bytes(want)


def test_faultfs_restart_under_a_reader_fails_no_call_and_serves_from_a_new_daemon(
        mounter, sample):
    src = sample(8 * MiB)
    data = read(src)
    m = mounter(src, args=["--chunk-size", "1M"])
    view = os.path.join(m.tag("field"), "field.bin")
    stop = threading.Event()
    errors: list[str] = []
    reads = [0]

    def reader():
        fd = os.open(view, os.O_RDONLY)
        i = 0
        while not stop.is_set():
            off = (i * 77 * KiB) % (len(data) - 4096)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                if os.pread(fd, 4096, off) != data[off:off + 4096]:
                    errors.append(f"wrong bytes at {off}")
            except OSError as exc:
                errors.append(str(exc))
            i += 1
            reads[0] += 1
        os.close(fd)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    old = stats(m)["pid"]
    r = run_faultfs("restart", m.path, timeout=300)
    assert r.returncode == 0, r.stderr
    assert f"pid {old} -> " in r.stdout
    time.sleep(0.3)
    stop.set()
    t.join(DEADLINE_S)
    assert errors == [] and reads[0] > 10
    served_again(m, old)


# -- the crash sweep: the daemon dies after reading a request, before answering it ------------

def _prepared(tag: str) -> None:
    with open(os.path.join(tag, "a"), "wb") as f:
        f.write(b"a" * 5000)


def _op_lookup(tag: str, data: bytes):
    assert os.stat(os.path.join(tag, "chunk_2")).st_size == 256 * KiB


def _op_open(tag: str, data: bytes):
    with open(os.path.join(tag, "chunk_2"), "rb") as f:
        assert f.read(10) == data[512 * KiB:512 * KiB + 10]


def _op_read(tag: str, data: bytes):
    fd = os.open(os.path.join(tag, "chunk_3"), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 100) == data[768 * KiB + 100:768 * KiB + 4196]
    finally:
        os.close(fd)


def _op_write(tag: str, data: bytes):
    fd = os.open(os.path.join(tag, "a"), os.O_RDWR)
    try:
        assert os.pwrite(fd, b"W" * 4096, 0) == 4096
    finally:
        os.close(fd)
    assert read(os.path.join(tag, "a")) == b"W" * 4096 + b"a" * 904


def _op_fsync(tag: str, data: bytes):
    fd = os.open(os.path.join(tag, "a"), os.O_RDWR)
    try:
        os.pwrite(fd, b"F" * 10, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert read(os.path.join(tag, "a"))[:12] == b"F" * 10 + b"aa"


def _op_setattr(tag: str, data: bytes):
    os.truncate(os.path.join(tag, "a"), 100)
    assert read(os.path.join(tag, "a")) == b"a" * 100


def _op_create(tag: str, data: bytes):
    fd = os.open(os.path.join(tag, "new"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)  # not EEXIST: the create the dead daemon did is answered, not done again
    assert os.path.exists(os.path.join(tag, "new"))


def _op_rename(tag: str, data: bytes):
    os.rename(os.path.join(tag, "a"), os.path.join(tag, "b"))  # not ENOENT the second time
    assert not os.path.exists(os.path.join(tag, "a"))
    assert read(os.path.join(tag, "b")) == b"a" * 5000


def _op_unlink(tag: str, data: bytes):
    os.unlink(os.path.join(tag, "a"))  # not ENOENT
    assert not os.path.exists(os.path.join(tag, "a"))


def _op_release(tag: str, data: bytes):
    f = open(os.path.join(tag, "chunk_1"), "rb")
    f.read(1)
    f.close()
    with open(os.path.join(tag, "chunk_1"), "rb") as f:
        assert f.read(5) == data[256 * KiB:256 * KiB + 5]


SWEEP = {"lookup": _op_lookup, "open": _op_open, "read": _op_read, "write": _op_write,
         "fsync": _op_fsync, "setattr": _op_setattr, "create": _op_create,
         "rename": _op_rename, "unlink": _op_unlink, "release": _op_release}
CASES = [(kind, "after") for kind in SWEEP] + [("write", "before"), ("create", "before"),
                                               ("rename", "before")]


@pytest.mark.parametrize(("kind", "when"), CASES, ids=[f"{k}-{w}" for k, w in CASES])
def test_the_daemon_dying_between_reading_a_request_and_answering_it_fails_no_call(
        mounter, sample, kind, when):
    src = sample(2 * MiB)
    data = read(src)
    # reads through the engine (the C path answers staged reads before Python sees them)
    m = mounter(src, args=["--chunk-size", "256K"],
                env={"FAULTFS_CRASH_AT": f"{kind}:{when}", "FAULTFS_FAST_READ": "0"})
    tag = m.tag("field")
    old = m.pid
    if kind in ("write", "fsync", "setattr", "rename", "unlink"):
        within(m, _prepared, tag)
    assert not within(m, os.path.exists, os.path.join(tag, ".arm-crash"))  # from here on
    within(m, SWEEP[kind], tag, data)
    snap = served_again(m, old)
    assert snap["daemon"]["takeovers"] == 1, f"the daemon did not die in {kind}"
    m.umount()
    again = mounter(store=m.store, mountpoint=m.path)  # what was answered is in the store
    if kind == "write":
        assert read(os.path.join(again.tag("field"), "a"))[:4096] == b"W" * 4096
    elif kind == "rename":
        assert sorted(os.listdir(again.tag("field"))).count("b") == 1


# -- bounds and failures ------------------------------------------------------------------------

def assert_dies_with_its_daemon(m) -> None:
    """kill -9 the daemon of ``m``: the mount is dead (as a daemon crash was before holders)."""
    os.kill(m.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{m.pid}") and time.monotonic() < deadline:
        time.sleep(0.02)
    m.pid = None
    with pytest.raises(OSError) as info:
        within(m, os.listdir, m.path)
    assert info.value.errno in DEAD


def test_a_daemon_that_keeps_crashing_is_given_up_and_the_mountpoint_is_reusable(
        mounter, sample):
    src = sample(1 * MiB)
    m = mounter(src, env={"FAULTFS_RESTARTS_MAX": "1"})
    holder = m.holder()
    assert holder is not None
    old = kill_daemon(m)
    served_again(m, old)
    kill_daemon(m)  # the second crash within the window: over the bound
    deadline = time.monotonic() + 20
    while os.path.exists(f"/proc/{holder}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{holder}"), "the holder gave up and exited"
    with pytest.raises(OSError) as info:
        os.listdir(m.path)
    assert info.value.errno in DEAD
    m.pid = None
    log = read(os.path.join(m.store, "log", "faultfs.log")).decode()
    assert "not restarting it again" in log
    again = mounter(store=m.store, mountpoint=m.path)  # cleans the dead mount, mounts anew
    assert read(os.path.join(again.tag("field"), "field.bin")) == read(src)


def test_a_holder_killed_leaves_the_daemon_serving_and_its_crash_ends_the_mount(
        mounter, sample):
    src = sample(1 * MiB)
    m = mounter(src)
    tag = m.tag("field")
    holder = m.holder()
    assert holder is not None
    os.kill(holder, signal.SIGKILL)
    time.sleep(0.3)
    assert within(m, read, os.path.join(tag, "chunk_0"))  # the daemon's own copy serves on
    assert_dies_with_its_daemon(m)
    again = mounter(store=m.store, mountpoint=m.path)
    assert read(os.path.join(again.tag("field"), "field.bin")) == read(src)


def test_a_mount_without_a_holder_ends_with_its_daemon(mounter, sample):
    m = mounter(sample(1 * MiB), args=["--no-holder"])
    assert m.holder() is None
    assert_dies_with_its_daemon(m)
    r = run_faultfs("restart", m.path)
    assert r.returncode != 0 and "no holder" in r.stderr, r.stderr


def test_a_shared_writable_map_keeps_working_across_a_kill_9(mounter, sample):
    np = pytest.importorskip("numpy")
    src = sample(4 * MiB)
    m = mounter(src, args=["--chunk-size", "1M"])
    path = os.path.join(m.tag("field"), "field.bin")
    arr = np.memmap(path, dtype=np.uint8, mode="r+")
    arr[:4096] = 7
    arr.flush()
    old = kill_daemon(m)
    # written once the killed daemon is gone, before its replacement serves: a request the
    # kernel hands a daemon in the instant it dies is ended with EIO (docs/decisions.md)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{old}") and time.monotonic() < deadline:
        time.sleep(0.005)

    def write_more():
        arr[MiB:MiB + 4096] = 9
        arr.flush()  # written back through the handle the new daemon opened again

    within(m, write_more)
    served_again(m, old)
    got = within(m, read, path)
    assert got[:4096] == b"\x07" * 4096 and got[MiB:MiB + 4096] == b"\x09" * 4096


def test_the_restart_torture_in_its_quick_form_sees_no_error(tmp_path):
    result = subprocess.run([os.path.join(ROOT, "scripts", "restart_torture"), "--quick",
                             "--json", str(tmp_path / "t.json")], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["events"] == 3 and doc["takeovers"] == 3
    assert (doc["errors"], doc["wrong_reads"], doc["writer_files_differing"]) == (0, 0, 0)


H5_READER = """
import os, sys, time, h5py, numpy as np
path, want, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + seconds
n = 0
dropper = os.open(path, os.O_RDONLY)  # drops the page cache: the reads reach the daemon
with h5py.File(path, "r") as f:
    ds = f["field"]
    print("open", flush=True)
    while time.monotonic() < end:
        i = n % ds.shape[0]
        os.posix_fadvise(dropper, 0, 0, os.POSIX_FADV_DONTNEED)
        row = ds[i]
        assert float(row.sum()) == want * (i + 1), (i, float(row.sum()))
        n += 1
print("reads", n, flush=True)
"""


def test_h5py_reading_a_dataset_never_sees_the_daemon_killed(mounter, tmp_path):
    h5py = pytest.importorskip("h5py")
    np = pytest.importorskip("numpy")
    src = tmp_path / "field.h5"
    with h5py.File(src, "w") as f:  # row i holds 1024 values of (i + 1): sums are known
        f["field"] = np.repeat(np.arange(1, 257, dtype=np.float64)[:, None], 1024, axis=1)
    m = mounter(str(src), args=["--chunk-size", "64K"])
    path = os.path.join(m.tag("field"), "field.h5")
    proc = subprocess.Popen([sys.executable, "-c", H5_READER, path, "1024", "6"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "open\n"
        for _ in range(2):
            time.sleep(1.0)
            old = kill_daemon(m)
            time.sleep(1.0)
            served_again(m, old)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out.startswith("reads ")


def test_locks_held_across_a_kill_9_still_exclude(mounter, sample):
    m = mounter(sample(1 * MiB))
    path = os.path.join(m.tag("field"), "field.bin")
    held = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as HDF5 takes it
        old = kill_daemon(m)
        other = within(m, os.open, path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
        served_again(m, old)
    finally:
        os.close(held)
