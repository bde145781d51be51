"""A mount whose daemon does not answer is recovered by ``faultfs umount`` and by ``faultfs
mount`` over it: the FUSE connection aborted, the daemon killed (its store freed), the mount
detached, the user told in one line; acknowledged writes come back at the next mount. The
daemon is made silent with SIGSTOP. Every command runs with a timeout, and a test that fails
aborts the connection itself, so nothing here can wedge the suite."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_faultfs

from faultfs.fuse import connection, daemons

pytestmark = pytest.mark.mount

KiB = 1 << 10
COMMAND_TIMEOUT = 60  # a command that has not returned by then hangs: the test fails


def read(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def gone(pid: int, wait: float = 10) -> bool:
    """Whether ``pid`` has exited (a zombie has: it holds no files, no lock)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def stopped(m):
    """SIGSTOP the daemon of ``m``; whatever happens, the connection is not left wedged."""
    entry = connection.find_mount(m.path)
    assert entry is not None and entry.fstype == connection.FSTYPE
    pid = m.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        again = connection.find_mount(m.path)
        if again is not None and again.minor == entry.minor:
            connection.abort(entry.minor)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        m.pid = None


def holding(path: str) -> subprocess.Popen:
    """A process that holds ``path`` open. Not this one: a process spawned while this one
    held a file of a silent mount would close it (a FLUSH to the daemon) before its exec."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, path], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    return proc


HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print('open', flush=True); time.sleep(600)"


def written(m) -> bytes:
    """Acknowledged writes through the view and a user blob, never synced; what the view
    holds after them."""
    tag = m.tag("field")
    view = os.path.join(tag, "field.bin")
    want = bytearray(read(view))
    fd = os.open(view, os.O_WRONLY)
    try:
        os.pwrite(fd, b"w" * 5000, 70 * KiB)
    finally:
        os.close(fd)
    want[70 * KiB:70 * KiB + 5000] = b"w" * 5000
    with open(os.path.join(tag, "notes"), "wb") as f:
        f.write(b"kept notes")
    return bytes(want)


def test_umount_ends_a_mount_whose_daemon_does_not_answer(mounter, sample):
    m = mounter(sample(256 * KiB), args=["--chunk-size", "64K"])
    want = written(m)
    holder = holding(os.path.join(m.tag("field"), "chunk_1"))  # a file left open
    try:
        with stopped(m) as pid:
            done = run_faultfs("umount", m.path, timeout=COMMAND_TIMEOUT)
            assert done.returncode == 0, done.stderr
            line = done.stderr.strip()
            assert len(line.splitlines()) == 1, line
            assert f"pid {pid}" in line and "did not answer" in line, line
            assert "aborted" in line and "killed" in line and "journal" in line, line
            assert gone(pid), "the daemon was killed"
            assert connection.find_mount(m.path) is None, "the mount is detached"
    finally:
        holder.kill()
        holder.communicate(timeout=COMMAND_TIMEOUT)  # (closes its pipe)
    again = mounter(store=m.store, mountpoint=m.path)  # the store is free, the writes are back
    assert read(os.path.join(again.tag("field"), "field.bin")) == want
    assert read(os.path.join(again.tag("field"), "notes")) == b"kept notes"


def test_mount_over_a_mount_whose_daemon_does_not_answer_takes_its_place(mounter, sample):
    m = mounter(sample(256 * KiB), args=["--chunk-size", "64K"])
    want = written(m)
    with stopped(m) as pid:
        done = run_faultfs("mount", m.path, "--store", m.store, "--reserve-mb", "0",
                           timeout=COMMAND_TIMEOUT)
        try:
            assert done.returncode == 0, done.stderr
            assert "did not answer" in done.stderr and f"pid {pid}" in done.stderr
            assert gone(pid)
            entry = connection.find_mount(m.path)
            assert entry is not None and entry.fstype == connection.FSTYPE
            assert read(os.path.join(m.tag("field"), "field.bin")) == want
            assert read(os.path.join(m.tag("field"), "notes")) == b"kept notes"
        finally:
            run_faultfs("umount", m.path, timeout=COMMAND_TIMEOUT)


def test_umount_of_a_busy_mount_whose_daemon_answers_is_refused_and_changes_nothing(
        mounter, sample):
    src = sample(64 * KiB)
    m = mounter(src, args=["--chunk-size", "64K"])
    view = os.path.join(m.tag("field"), "field.bin")
    with open(view, "rb") as f:
        done = run_faultfs("umount", m.path, timeout=COMMAND_TIMEOUT)
        assert done.returncode != 0 and "busy" in done.stderr, done.stderr
        assert f.read() == read(src)
    assert m.stats()["pid"] == m.pid, "the same daemon serves on"


def test_umount_of_a_mount_that_is_not_faultfs_is_refused(small_fs):
    fs = small_fs(64)
    done = run_faultfs("umount", str(fs), timeout=COMMAND_TIMEOUT)
    assert done.returncode != 0 and "not a faultfs one" in done.stderr, done.stderr
    assert os.path.ismount(fs)


CHUNKS = 512


def test_umount_says_so_when_the_daemon_is_killed_before_its_unmount_finished(mounter, sample):
    """``faultfs umount`` returned 0 when the daemon was killed while it folded the journal
    at the unmount: the mount was gone, its writes not folded (kept in the journal, nothing
    lost), and the user was told nothing."""
    src = sample(CHUNKS * 64 * KiB)
    m = mounter(src, args=["--chunk-size", "64K", "--journal-mb", "1024"])
    view = os.path.join(m.tag("field"), "field.bin")
    fd = os.open(view, os.O_WRONLY)
    try:  # a write into each chunk: the unmount folds them all, each over its source — long
        for i in range(CHUNKS):  # enough that the kill lands in the fold on a loaded machine
            os.pwrite(fd, b"w%03d" % i, i * 64 * KiB + 100)
    finally:
        os.close(fd)
    pid = m.pid
    umount = subprocess.Popen([sys.executable, "-m", "faultfs.cli", "umount", m.path],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    deadline = time.monotonic() + COMMAND_TIMEOUT
    while os.path.ismount(m.path) and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)  # the mount is gone: the daemon is folding
    _, err = umount.communicate(timeout=COMMAND_TIMEOUT)
    m.pid = None
    assert umount.returncode != 0, err
    assert "ended before it finished" in err and "journal" in err, err
    assert len(err.strip().splitlines()) == 1, err
    m2 = mounter(store=m.store, mountpoint=m.path)
    data = read(os.path.join(m2.tag("field"), "field.bin"))
    assert all(data[i * 64 * KiB + 100:i * 64 * KiB + 104] == b"w%03d" % i for i in range(CHUNKS))
    run_faultfs("umount", m2.path, check=True)  # a clean unmount says nothing


# a daemon's record, written as a daemon writes it, for a connection number given (no mount)
RECORDED = r"""
import sys, time
from types import SimpleNamespace
from faultfs.fuse import daemons
daemons.find_mount = lambda path: SimpleNamespace(minor=int(sys.argv[1]))
daemons.DaemonRecord(sys.argv[2]).write()
print("recorded", flush=True)
time.sleep(60)
"""


def test_a_killed_daemons_record_outlives_a_new_mount_on_its_connection_number(tmp_path):
    """The kernel reuses a FUSE connection number as soon as a mount is gone: a mount made on
    it while ``faultfs umount`` waited for the old daemon replaced the old daemon's record,
    and the umount of a daemon killed in its fold said nothing (1 full suite in 3)."""
    if daemons.run_dir() is None:
        pytest.skip("no runtime directory for daemon records (not root, no XDG_RUNTIME_DIR)")
    minor, where = 987654, str(tmp_path / "mnt")
    procs = []
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", RECORDED, str(minor), where],
                                 stdout=subprocess.PIPE, text=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            assert p.stdout is not None and p.stdout.readline().strip() == "recorded"
            procs.append(p)
        old, new = procs
        old.kill()
        old.wait()
        assert daemons.left_behind(minor, old.pid), "the killed daemon's record is still there"
        assert not daemons.left_behind(minor, old.pid)  # dropped once seen
        assert daemons.daemon_of(minor, where) == new.pid
    finally:
        for p in procs:
            p.kill()
            p.wait()
            assert p.stdout is not None
            p.stdout.close()
            daemons.forget(minor, p.pid)
