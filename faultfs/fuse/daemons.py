"""Which process serves a mount: a record per FUSE connection, written by the daemon once
its mount answers and removed when it ends, so that ``faultfs umount`` and ``faultfs mount``
can end a daemon that no longer answers (asking the mount for its pid would wait on it). A
daemon removes its record only once its unmount finished (every write folded): a record
left by a daemon that is gone says it was killed or failed on the way (``left_behind``).

The records live in ``/run/faultfs`` (root) or ``$XDG_RUNTIME_DIR/faultfs``: memory that a
reboot clears, as it clears mounts. A record is believed only while it names the mountpoint
asked about and a live process that started when the record says (a pid can be reused).
Records are a help, never a requirement: without one the daemon is not ended, and the user
is told so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from faultfs.fuse.connection import find_mount

log = logging.getLogger("faultfs.mount")


def run_dir() -> str | None:
    if os.geteuid() == 0:
        return "/run/faultfs"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "faultfs") if runtime else None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def holder_of(pid: int) -> int | None:
    """The holder (fuse/holder.py) whose daemon ``pid`` is, if it has one: its parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            parent = int(f.read().rsplit(b")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            return parent if b"faultfs.fuse.holder" in f.read() else None
    except (OSError, ValueError, IndexError):
        return None


def daemon_of(minor: int, mountpoint: str) -> int | None:
    """The pid of the daemon serving connection ``minor`` at ``mountpoint``, if recorded."""
    path = _path(minor)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        pid, started = int(doc["pid"]), int(doc["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if doc.get("mountpoint") != mountpoint or start_time(pid) != started:
        return None
    return pid


def left_behind(minor: int, pid: int) -> bool:
    """Whether daemon ``pid``, now gone, left its record of connection ``minor`` (it did not
    finish its unmount); the record is dropped."""
    path = _path(minor)
    if path is None:
        return False
    try:
        with open(path, "rb") as f:
            left = json.loads(f.read()).get("pid") == pid
    except (OSError, ValueError, AttributeError):
        return False
    if left:
        forget(minor)
    return left


def forget(minor: int) -> None:
    """Drop the record of connection ``minor`` (its daemon was ended)."""
    path = _path(minor)
    if path is not None:
        with contextlib.suppress(OSError):
            os.unlink(path)


class DaemonRecord:
    """This process's record, as the daemon of the mount at ``mountpoint``."""

    def __init__(self, mountpoint: str) -> None:
        self.mountpoint = mountpoint
        self.minor: int | None = None

    def write(self) -> None:
        """Record this process for the topmost mount at the mountpoint, just made (best
        effort: a failure is logged)."""
        directory = run_dir()
        if directory is None:
            return
        tmp = ""
        try:
            entry = find_mount(self.mountpoint)
            if entry is None:
                return
            minor = entry.minor
            doc = {"pid": os.getpid(), "start": start_time(os.getpid()),
                   "mountpoint": self.mountpoint}
            path = os.path.join(directory, f"conn-{minor}")
            tmp = f"{path}.{os.getpid()}.tmp"
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, json.dumps(doc).encode())
            finally:
                os.close(fd)
            os.replace(tmp, path)  # (no fsync: the record lives as long as the boot)
        except OSError as exc:
            log.warning("cannot record this daemon in %s (%s): `faultfs umount` of a mount "
                        "that stops answering will not end it", directory, exc.strerror)
            if tmp:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return
        self.minor = minor

    def remove(self) -> None:
        """Remove the record, if it is still this process's."""
        if self.minor is not None and daemon_of(self.minor, self.mountpoint) == os.getpid():
            forget(self.minor)
        self.minor = None


def _path(minor: int) -> str | None:
    directory = run_dir()
    return None if directory is None else os.path.join(directory, f"conn-{minor}")
