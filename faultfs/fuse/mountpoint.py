"""Mountpoints: check one before mounting, clean a dead or silent mount there, unmount and
wait for the daemon, read a live mount's counters. No pyfuse3 here: the CLI uses it without
serving.

Invariants:
- A mount is only looked at through ``connection`` (mountinfo, a bounded probe) before its
  daemon is known to answer: ``faultfs umount`` and ``faultfs mount`` never hang on a mount
  whose daemon is stopped, deadlocked or stuck in the kernel.
- A faultfs mount whose daemon does not answer is recovered, never left wedged: its FUSE
  connection is aborted, its daemon killed, the mount detached, and the user told in one line.
  Acknowledged writes are in the store's journal (replayed at the next mount); bytes written
  through a shared mapping and not yet flushed to the daemon are lost.
- ``unmount`` succeeds only when the daemon finished its unmount (its record removed, every
  write folded); a daemon that ended on the way is an error that says where the writes are.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import time

from faultfs.core.names import CTL_NAME
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.fuse import connection, daemons
from faultfs.fuse.connection import ANSWERS, FSTYPE, GONE, PROBE_S, MountEntry

log = logging.getLogger("faultfs.mount")

UNMOUNT_WAIT_S = 120.0  # how long `faultfs umount` waits for the daemon (it folds writes)
KILLED_WAIT_S = 10.0  # how long a killed daemon gets to be gone (its store lock with it)
ZOMBIE_GRACE_S = 3.0  # how long a killed daemon's other threads get once its main one exited


def lazy_unmount(path: str) -> None:
    """Detach a (dead or aborted) FUSE mount at ``path``."""
    for cmd in (["fusermount3", "-u", "-z", path], ["umount", "-l", path]):
        if shutil.which(cmd[0]) is None:
            continue
        done = connection.run_bounded(cmd)
        if done is not None and done.returncode == 0:
            return
    raise FaultfsError(f"cannot detach the dead mount at {path}", errno.EBUSY)


def recover(entry: MountEntry, pid: int | None, why: str) -> str:
    """End the faultfs mount ``entry`` whose daemon ``why`` (does not answer): abort its
    connection, kill its daemon, detach it. Returns the one line that says so."""
    path = entry.mountpoint
    holder = daemons.holder_of(pid) if pid is not None else None
    connection.abort(entry.minor)
    if holder is not None:  # the mount ends whole: its holder must not start another daemon
        _kill(holder)
    ended = pid is not None and _kill(pid)
    if pid is not None:
        daemons.forget(entry.minor, pid)
    lazy_unmount(path)
    who = f"the daemon of {path}" + (f" (pid {pid})" if pid is not None else "")
    did = ("aborted its FUSE connection, "
           + ("killed the daemon" if ended else
              "found no record of the daemon (end it yourself: it holds its store)"
              if pid is None else
              "killed the daemon (it has not exited yet; its store is free once it has)")
           + " and detached the mount")
    return (f"{who} {why}: {did}; bytes written through mmap and not yet flushed may be lost, "
            "acknowledged writes are in the store's journal and are replayed at the next mount")


def _kill(pid: int) -> bool:
    """SIGKILL ``pid`` (a stopped process too) and wait, bounded, until it is gone."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    return _wait_gone(pid, KILLED_WAIT_S)


def _wait_gone(pid: int, wait: float) -> bool:
    """Wait until ``pid`` is gone. Its main thread a zombie counts (its parent may never reap
    it), after a grace for its other threads: until the last one exits, its descriptors —
    the store's lock among them — stay open."""
    deadline = time.monotonic() + wait
    zombie_until = None
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if _is_zombie(pid):
            now = time.monotonic()
            zombie_until = zombie_until or now + ZOMBIE_GRACE_S
            if now >= zombie_until:
                return True
        if time.monotonic() >= deadline:
            return zombie_until is not None
        time.sleep(0.05)


def prepare_mountpoint(path: str) -> tuple[str, str | None]:
    """Return the absolute mountpoint after cleaning a dead mount there, or a faultfs mount
    whose daemon does not answer (and the line that says what was done, else None); refuse
    anything but an existing empty directory that is not already mounted."""
    path = connection.mount_path(path)
    note = None
    entry = connection.find_mount(path)
    if entry is not None and entry.fstype.startswith("fuse"):
        pid = daemons.daemon_of(entry.minor, path) if entry.fstype == FSTYPE else None
        state = connection.probe(path)
        if state == GONE:
            log.warning("cleaning the dead mount at %s (its daemon is gone)", path)
            lazy_unmount(path)
        elif state != ANSWERS:
            if entry.fstype != FSTYPE:
                raise InvalidInput(f"mountpoint {path} is a {entry.fstype} mount whose daemon "
                                   "does not answer", errno.EBUSY)
            note = recover(entry, pid, f"did not answer within {PROBE_S:.0f} s")
            log.warning("%s", note)
    if not os.path.exists(path):
        raise InvalidInput(f"mountpoint {path} does not exist", errno.ENOENT)
    if not os.path.isdir(path):
        raise InvalidInput(f"mountpoint {path} is not a directory", errno.ENOTDIR)
    if os.path.ismount(path):
        raise InvalidInput(f"mountpoint {path} is already mounted", errno.EBUSY)
    if os.listdir(path):
        raise InvalidInput(f"mountpoint {path} is not empty", errno.ENOTEMPTY)
    return path, note


def read_stats(mountpoint: str) -> dict:
    """The JSON counters of a running mount."""
    path = os.path.join(os.path.abspath(mountpoint), CTL_NAME, "stats")
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        raise InvalidInput(f"{mountpoint} is not a faultfs mount", errno.EINVAL) from None
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            raise FaultfsError(f"the faultfs daemon of {mountpoint} is gone (dead mount); "
                               f"`faultfs umount {mountpoint}` cleans it", exc.errno) from None
        raise FaultfsError(f"cannot read stats of {mountpoint}: {exc.strerror}", exc.errno or errno.EIO) from None


def unmount(mountpoint: str, *, wait: float = UNMOUNT_WAIT_S) -> str | None:
    """Unmount ``mountpoint`` and wait for its daemon to exit (so the store is free). A
    daemon that does not answer is ended (``recover``): the line that says so is returned.
    A daemon that ended before its unmount finished (killed while folding) is a
    FaultfsError: the mount is gone, its writes are in the journal."""
    path = connection.mount_path(mountpoint)
    entry = connection.find_mount(path)
    if entry is None:
        raise InvalidInput(f"{path} is not mounted", errno.EINVAL)
    if entry.fstype != FSTYPE:
        raise InvalidInput(f"{path} is a {entry.fstype} mount, not a faultfs one", errno.EINVAL)
    pid = daemons.daemon_of(entry.minor, path)
    state = connection.probe(path)
    if state == GONE:
        lazy_unmount(path)
        return None
    if state != ANSWERS:
        return recover(entry, pid, f"did not answer within {PROBE_S:.0f} s")
    if pid is None:  # not recorded (yet): its stats say it
        pid = connection.stats_pid(path)
    holder = daemons.holder_of(pid) if pid is not None else None
    result = connection.run_bounded(["fusermount3", "-u", path])
    if result is None:
        return recover(entry, pid, f"did not let the mount go within {connection.COMMAND_S:.0f} s")
    if result.returncode != 0:
        reason = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "unknown error"
        if "busy" in reason.lower():
            raise FaultfsError(f"{path} is busy: close the files open under it first", errno.EBUSY)
        raise FaultfsError(f"unmounting {path} failed: {reason}", errno.EIO)
    if pid is None or pid == os.getpid():
        return None
    for who, gone in (("daemon", pid), ("holder", holder)):  # the holder ends its standby
        if gone is not None and not _wait_gone(gone, wait):
            raise FaultfsError(f"the {who} (pid {gone}) of {path} did not exit within "
                               f"{wait:.0f} s", errno.ETIMEDOUT)
    if daemons.left_behind(entry.minor, pid):
        raise FaultfsError(f"{path} is unmounted, but its daemon (pid {pid}) ended before it "
                           "finished (killed, or failed: see the store's log): its writes may "
                           "not all be folded into the store; nothing acknowledged is lost — "
                           "they are in the store's journal and the next mount replays them",
                           errno.EIO)
    return None


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b")")[-1].split()[0] == b"Z"
    except OSError:
        return True
