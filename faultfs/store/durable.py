"""Durability helpers of the store: temp + fsync + rename, and directory fsyncs.

Only ``faultfs/store`` makes data durable (this module for whole files; the checkpoint
manager, ``metadata.py``, fsyncs its ping-pong slots and WAL through its ``FileOps`` seam).

``write_atomic`` = write a temporary file in the same directory, fsync it, rename it into
place, fsync the directory. After a crash the old or the new file is there, never a mix.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_parts(fd: int, parts: Iterable[bytes | bytearray | memoryview],
                pwrite: Callable[[int, Any, int], int] = os.pwrite, *, at: int = 0) -> None:
    """Write the concatenation of ``parts`` at offset ``at`` of ``fd``, a ``pwrite`` per
    part (a ``pwritev`` of a header and a payload copied slower into the page cache here);
    ``pwrite``: the call that writes (a ``FileOps``'s, where crashes are simulated)."""
    off = at
    for part in parts:
        view = memoryview(part)
        while view:
            written = pwrite(fd, view, off)
            off += written
            view = view[written:]


def write_atomic(path: str, parts: Iterable[bytes | memoryview], *, mode: int = 0o644,
                 durable: bool = True, sync_dir: bool = True) -> None:
    """Replace ``path`` with the concatenation of ``parts``, atomically.

    ``durable=False`` skips both fsyncs: for data that can always be re-fetched, where a lost
    file after power loss costs one re-fault and a torn one fails verification."""
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f"t-{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_parts(fd, parts)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    if durable and sync_dir:
        fsync_dir(directory)
