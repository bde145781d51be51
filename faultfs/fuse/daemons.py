"""Which process serves a mount: a record per daemon of a FUSE connection
(``conn-<minor>.<pid>``), written by the daemon once its mount answers and removed when it
ends, so that ``faultfs umount`` and ``faultfs mount``
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
from typing import Any

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
    directory = run_dir()
    if directory is None:
        return None
    try:
        names = [n for n in os.listdir(directory)
                 if n.startswith(f"conn-{minor}.") or n == f"conn-{minor}"]
    except OSError:
        return None
    for name in names:
        doc = _read(os.path.join(directory, name))
        if doc is None:
            continue
        pid, started = doc["pid"], doc["start"]
        if doc.get("mountpoint") == mountpoint and start_time(pid) == started:
            return pid
    return None


def left_behind(minor: int, pid: int) -> bool:
    """Whether daemon ``pid``, now gone, left its record of connection ``minor`` (it did not
    finish its unmount); the record is dropped. Records are per daemon: a mount made since
    on the connection number the kernel freed writes its own, never over this one."""
    return forget(minor, pid)


def forget(minor: int, pid: int) -> bool:
    """Drop the record of daemon ``pid`` of connection ``minor``; whether there was one."""
    for path in (_path(minor, pid), _path(minor)):  # (conn-<minor>: an earlier faultfs's)
        doc = _read(path) if path is not None else None
        if doc is not None and doc["pid"] == pid:
            assert path is not None
            with contextlib.suppress(OSError):
                os.unlink(path)
            return True
    return False


def _read(path: str) -> dict[str, Any] | None:
    """A record, its pid and start checked to be integers; None when absent or damaged."""
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        doc["pid"], doc["start"] = int(doc["pid"]), int(doc["start"])  # (not a dict: raises)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return doc


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
            path = os.path.join(directory, f"conn-{minor}.{os.getpid()}")
            tmp = f"{path}.tmp"
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
        if self.minor is not None:
            forget(self.minor, os.getpid())
        self.minor = None


def _path(minor: int, pid: int | None = None) -> str | None:
    """The record of daemon ``pid`` of connection ``minor`` (None: the single record an
    earlier faultfs kept per connection, which a later mount on that number replaced)."""
    directory = run_dir()
    if directory is None:
        return None
    return os.path.join(directory, f"conn-{minor}" if pid is None else f"conn-{minor}.{pid}")
