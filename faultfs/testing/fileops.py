"""File operations that fail or wait where a test says: ``FaultyOps``, the failure fixture of the
durable formats (the write journal, dirty files, write states), beside ``crashfs.py``'s crash.

``FaultyOps`` wraps a ``FileOps`` (the real file system unless told otherwise) and runs the
*rules* a test adds before the calls they match — a call by its name (``pwrite``, ``fsync``,
``rename`` …) and a path (a substring of it, or a test of it; calls on a descriptor match the
path it was opened at). A rule's action may raise (the call fails, having done nothing), or
wait, or note something, and then the call goes on. An engine takes one as ``writes_ops``::

    ops = FaultyOps()
    eng = engine_for(store, writes_ops=ops)
    full = ops.when("pwrite", "/journal/", fail(errno.ENOSPC))   # the store is full
    ...
    full.off()

Invariants:
- A rule acts on the calls it matches from the ``after``-th on (those before go through), at
  most ``times`` of them, while it is on; each call it acted on is counted (``acted``).
- Rules are checked from any thread (the I/O pool's): their counts are kept under a lock, and
  an action that waits blocks only the thread of its call.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from faultfs.store.fileops import FileOps, OsFileOps

Action = Callable[[str], None]


def fail(code: int = errno.EIO) -> Action:
    """An action that fails the call with ``OSError(code)``."""

    def raise_(path: str) -> None:
        raise OSError(code, os.strerror(code), path)

    return raise_


class Rule:
    """What a ``FaultyOps`` does before the calls it matches (see the module docstring)."""

    def __init__(self, call: str, where: str | Callable[[str], bool], action: Action, *,
                 after: int = 0, times: int | None = None) -> None:
        self.call = call
        self.where = where
        self.action = action
        self.after = after  # matching calls let through before it acts
        self.times = times  # calls it acts on at most (None: every one)
        self.matched = 0
        self.acted = 0
        self.active = True

    def on(self, *, after: int | None = None) -> Rule:
        """Act again (from the ``after``-th matching call from now on, when given)."""
        if after is not None:
            self.after, self.matched = after, 0
        self.active = True
        return self

    def off(self) -> Rule:
        self.active = False
        return self

    def matches(self, call: str, path: str) -> bool:
        if not self.active or call != self.call:
            return False
        return self.where(path) if callable(self.where) else self.where in path


class FaultyOps:
    """``FileOps`` that run a test's rules before the real calls; see the module docstring."""

    def __init__(self, inner: FileOps | None = None) -> None:
        self.inner = inner or OsFileOps()
        self.rules: list[Rule] = []
        self._paths: dict[int, str] = {}  # descriptor -> the path it was opened at
        self._lock = threading.Lock()

    def when(self, call: str, where: str | Callable[[str], bool], action: Action, *,
             after: int = 0, times: int | None = None) -> Rule:
        """Run ``action(path)`` before each ``call`` on a path ``where`` names (see
        ``Rule``); the rule, to turn off and on."""
        rule = Rule(call, where, action, after=after, times=times)
        self.rules.append(rule)
        return rule

    def _before(self, call: str, path: str) -> None:
        todo = []
        with self._lock:
            for rule in self.rules:
                if not rule.matches(call, path):
                    continue
                rule.matched += 1
                if rule.matched > rule.after and (rule.times is None or rule.acted < rule.times):
                    rule.acted += 1
                    todo.append(rule.action)
        for action in todo:
            action(path)

    def _fd(self, call: str, fd: int) -> None:
        self._before(call, self._paths.get(fd, ""))

    # -- FileOps -----------------------------------------------------------------------------

    def exists(self, path: str) -> bool:
        return self.inner.exists(path)

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        self._before("open", path)
        fd = self.inner.open(path, flags, mode)
        self._paths[fd] = path
        return fd

    def close(self, fd: int) -> None:
        self._fd("close", fd)
        self._paths.pop(fd, None)
        self.inner.close(fd)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        self._fd("pread", fd)
        return self.inner.pread(fd, size, offset)

    def pwrite(self, fd: int, data: bytes, offset: int) -> int:
        self._fd("pwrite", fd)
        return self.inner.pwrite(fd, data, offset)

    def fsync(self, fd: int) -> None:
        self._fd("fsync", fd)
        self.inner.fsync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        self._fd("ftruncate", fd)
        self.inner.ftruncate(fd, length)

    def size(self, fd: int) -> int:
        return self.inner.size(fd)

    def rename(self, src: str, dst: str) -> None:
        self._before("rename", dst)
        self.inner.rename(src, dst)

    def fsync_dir(self, path: str) -> None:
        self._before("fsync_dir", path)
        self.inner.fsync_dir(path)

    def unlink(self, path: str) -> None:
        self._before("unlink", path)
        self.inner.unlink(path)

    def listdir(self, path: str) -> list[str]:
        return self.inner.listdir(path)

    def makedirs(self, path: str) -> None:
        self.inner.makedirs(path)
