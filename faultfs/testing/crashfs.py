"""A disk that remembers what an fsync made durable, and a crash that forgets the rest.

``SimDisk`` holds files by path in memory. Every write, truncate, create, rename and unlink
done through ``SimOps`` (a ``faultfs.store.fileops.FileOps``) is applied at once — readers see
it — and remembered as *pending* until the file (for data) or its directory (for names) is
fsynced. ``SimDisk.crash(rng)`` returns the disk a reboot after a power cut could find: each
pending data operation applied, dropped, or torn (a random mix of old and new bytes, cut
short), and a random prefix of the pending name operations kept. ``SimOps(disk, crash_at=n)``
raises ``SimulatedCrash`` at its n-th mutation, so a test can crash at every write and fsync
point of a durable format in turn (as SQLite's crash tests do). Its operations run one at a
time, as a kernel's do: the I/O pool calls them from several threads at once (a checkpoint's
folds), and two files opened together must never share a descriptor or an inode.
"""

from __future__ import annotations

import functools
import os
import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class SimulatedCrash(Exception):
    """The power went out at this operation (it did not happen)."""


class _Inode:
    def __init__(self, data: bytes = b"") -> None:
        self.durable = bytes(data)
        self.current = bytearray(data)
        self.pending: list[tuple] = []  # ("write", offset, data) | ("truncate", length)


def _apply(buf: bytearray, op: tuple) -> None:
    if op[0] == "write":
        _, off, data = op
        if len(buf) < off:
            buf.extend(bytes(off - len(buf)))
        buf[off:off + len(data)] = data
    else:
        del buf[op[1]:]


class SimDisk:
    """An in-memory file system that remembers what an fsync made durable."""

    def __init__(self, files: dict[str, bytes] | None = None) -> None:
        self.inodes: dict[int, _Inode] = {}
        self.names: dict[str, int] = {}
        for name, data in (files or {}).items():
            ino = len(self.inodes) + 1
            self.inodes[ino] = _Inode(data)
            self.names[name] = ino
        self.durable_names = dict(self.names)
        self.name_ops: list[tuple] = []

    def read(self, path: str) -> bytes:
        return bytes(self.inodes[self.names[path]].current)

    def crash(self, rng: random.Random) -> SimDisk:
        """The disk as a reboot after a power cut would find it."""
        names = dict(self.durable_names)
        keep = rng.randint(0, len(self.name_ops))
        for op in self.name_ops[:keep]:
            if op[0] == "link":
                names[op[1]] = op[2]
            elif op[0] == "unlink":
                names.pop(op[1], None)
            else:
                names.pop(op[1], None)
                names[op[2]] = op[3]
        files = {}
        for name, ino in names.items():
            node = self.inodes[ino]
            buf = bytearray(node.durable)
            for op in node.pending:
                fate = rng.choice(("apply", "drop", "tear"))
                if fate == "apply" or (fate == "tear" and op[0] == "truncate"):
                    _apply(buf, op)
                elif fate == "tear":
                    _, off, data = op
                    old = bytes(buf[off:off + len(data)]).ljust(len(data), b"\0")
                    mixed = bytes(n if rng.random() < 0.5 else o
                                  for n, o in zip(data, old, strict=True))
                    _apply(buf, ("write", off, mixed[:rng.randint(0, len(data))]))
            files[name] = bytes(buf)
        return SimDisk(files)


def _serial(method: F) -> F:
    """One operation of a ``SimOps`` at a time (its lock held)."""

    @functools.wraps(method)
    def one(self: SimOps, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return method(self, *args, **kwargs)

    return one  # type: ignore[return-value]


class SimOps:
    """``FileOps`` over a ``SimDisk``, raising SimulatedCrash at the n-th mutation."""

    def __init__(self, disk: SimDisk, crash_at: int | None = None) -> None:
        self.lock = threading.RLock()
        self.disk = disk
        self.crash_at = crash_at
        self.points = 0
        self.crashed = False  # the crash point was reached (every later mutation fails too)
        self.fds: dict[int, int] = {}

    def _point(self) -> None:
        if self.crash_at is not None and self.points == self.crash_at:
            self.crashed = True
            raise SimulatedCrash
        self.points += 1

    @_serial
    def exists(self, path: str) -> bool:
        return path in self.disk.names

    @_serial
    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        d = self.disk
        if path in d.names and flags & os.O_CREAT and flags & os.O_EXCL:
            raise FileExistsError(path)
        if path not in d.names:
            if not flags & os.O_CREAT:
                raise FileNotFoundError(path)
            self._point()
            ino = max(d.inodes, default=0) + 1
            d.inodes[ino] = _Inode()
            d.names[path] = ino
            d.name_ops.append(("link", path, ino))
        ino = d.names[path]
        if flags & os.O_TRUNC:
            self._truncate(ino, 0)
        fd = max(self.fds, default=2) + 1
        self.fds[fd] = ino
        return fd

    @_serial
    def close(self, fd: int) -> None:
        del self.fds[fd]

    @_serial
    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return bytes(self.disk.inodes[self.fds[fd]].current[offset:offset + size])

    @_serial
    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        self._point()
        node = self.disk.inodes[self.fds[fd]]
        op = ("write", offset, bytes(data))
        node.pending.append(op)
        _apply(node.current, op)
        return len(data)

    def _truncate(self, ino: int, length: int) -> None:
        self._point()
        node = self.disk.inodes[ino]
        node.pending.append(("truncate", length))
        _apply(node.current, ("truncate", length))

    @_serial
    def ftruncate(self, fd: int, length: int) -> None:
        self._truncate(self.fds[fd], length)

    @_serial
    def fsync(self, fd: int) -> None:
        self._point()
        node = self.disk.inodes[self.fds[fd]]
        node.durable = bytes(node.current)
        node.pending.clear()

    @_serial
    def size(self, fd: int) -> int:
        return len(self.disk.inodes[self.fds[fd]].current)

    @_serial
    def rename(self, src: str, dst: str) -> None:
        self._point()
        d = self.disk
        if src not in d.names:
            raise FileNotFoundError(src)
        ino = d.names.pop(src)
        d.names[dst] = ino
        d.name_ops.append(("rename", src, dst, ino))

    @_serial
    def unlink(self, path: str) -> None:
        self._point()
        d = self.disk
        if path not in d.names:
            raise FileNotFoundError(path)
        del d.names[path]
        d.name_ops.append(("unlink", path))

    @_serial
    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return sorted({name[len(prefix):].split("/", 1)[0] for name in self.disk.names
                       if name.startswith(prefix)})

    @_serial
    def makedirs(self, path: str) -> None:
        return  # directories are implicit in paths

    @_serial
    def fsync_dir(self, path: str) -> None:
        """Make the pending name operations of directory ``path`` durable (those of other
        directories stay pending: each directory changed needs its own fsync)."""
        self._point()
        d = self.disk
        here = path.rstrip("/")
        rest = []
        for op in d.name_ops:
            if op[0] == "link" and os.path.dirname(op[1]) == here:
                d.durable_names[op[1]] = op[2]
            elif op[0] == "unlink" and os.path.dirname(op[1]) == here:
                d.durable_names.pop(op[1], None)
            elif op[0] == "rename" and here in (os.path.dirname(op[1]), os.path.dirname(op[2])):
                d.durable_names.pop(op[1], None)
                d.durable_names[op[2]] = op[3]
            else:
                rest.append(op)
        d.name_ops = rest
