"""Looking at a store's entries without trusting them: is the root a store, can it be changed,
what stands at a path (its kind and size), streamed listings, small JSON files, and the
findings for entries that are only temp files or unknown.

Invariants:
- Nothing outside the store is looked at: a link is never followed (``lstat``, ``scandir``
  entries not followed, files opened with ``open_regular``).
- Memory stays flat: directories are streamed, never listed whole; a JSON file is read up
  to ``MAX_STATE_BYTES``.
"""

from __future__ import annotations

import errno
import json
import os
import stat as stat_mod
from collections.abc import Iterator

from faultfs.errors import FaultfsError, InvalidInput
from faultfs.store.entries import ForeignEntry, open_regular, real_dir
from faultfs.store.fsck.findings import KEEP_UNKNOWN, LEFTOVER, ORPHANED, OTHER, TEMP, Finding

MAX_STATE_BYTES = 1 << 20  # a tag or write state larger than this is not one we wrote


def check_store_root(root: str) -> str:
    """The absolute root of an existing store; InvalidInput when ``root`` is not one."""
    root = os.path.abspath(os.path.expanduser(root))
    if not os.path.isdir(root):
        raise InvalidInput(f"store {root} is not a directory", errno.ENOTDIR)
    tags = os.path.join(root, "tags")
    if os.path.islink(tags) or not os.path.isdir(tags):
        raise InvalidInput(f"{root} is not a faultfs store (it has no tags directory)",
                           errno.ENOENT)
    return root


def check_writable(root: str) -> None:
    """FaultfsError when nothing in the store can be removed (a repair would fail midway)."""
    st = os.statvfs(root)
    if st.f_flag & os.ST_RDONLY or not os.access(root, os.W_OK):
        raise FaultfsError(f"store {root} cannot be changed (read-only file system or no "
                           "permission): run without repairing", errno.EROFS)


def scan(path: str) -> Iterator[os.DirEntry]:
    """The entries of directory ``path``, streamed; none when it is absent or not a real
    directory (a link to one is never followed: nothing outside the store is looked at, let
    alone removed)."""
    if not real_dir(path):
        return
    try:
        it = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    with it:
        yield from it


def is_temp(name: str) -> bool:
    return name.startswith("t-") and name.endswith(".tmp")


def kind(mode: int) -> str:
    for test, what in ((stat_mod.S_ISDIR, "a directory"), (stat_mod.S_ISLNK, "a symbolic link"),
                       (stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a device"), (stat_mod.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a regular file"


def lsize(path: str) -> tuple[int, int]:
    """``(mode, bytes)`` of the entry itself (a directory counts what is under it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0
    if stat_mod.S_ISDIR(st.st_mode):
        return st.st_mode, sum(s for _, s in tree_sizes(path))
    return st.st_mode, st.st_size


def tree_sizes(path: str) -> Iterator[tuple[str, int]]:
    """``(path, bytes)`` of every non-directory under ``path``, streamed, links not followed."""
    for entry in scan(path):
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from tree_sizes(entry.path)
            else:
                yield entry.path, entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue


def measure(root: str) -> tuple[int, int]:
    """``(files, bytes)`` under the store's ``tags`` and ``writes``: the total a progress bar
    counts towards (one ``stat`` per file, no file is opened; streamed)."""
    files = total = 0
    for sub in ("tags", "writes"):
        for _, size in tree_sizes(os.path.join(root, sub)):
            files += 1
            total += size
    return files, total


def temp_finding(path: str) -> Finding:
    _, size = lsize(path)
    return Finding(TEMP, LEFTOVER, path, size,
                   "temporary file of an interrupted write (never renamed into place, never "
                   "read)")


def unknown_finding(path: str) -> Finding:
    mode, size = lsize(path)
    what = "file" if stat_mod.S_ISREG(mode) else kind(mode)
    return Finding(OTHER, ORPHANED, path, size, f"{what} faultfs does not know", KEEP_UNKNOWN)


def read_json(path: str) -> tuple[dict | None, str]:
    """A small JSON object file: ``(doc, "")`` or ``(None, what is wrong)``."""
    try:
        fd = open_regular(path)
    except ForeignEntry:
        mode, _ = lsize(path)
        return None, f"{kind(mode)}, not a file"
    if fd is None:
        return None, "vanished while it was checked"
    try:
        raw = os.pread(fd, MAX_STATE_BYTES + 1, 0)
    finally:
        os.close(fd)
    if len(raw) > MAX_STATE_BYTES:
        return None, f"over {MAX_STATE_BYTES} bytes"
    try:
        doc = json.loads(raw)
    except ValueError:
        return None, "not valid JSON"
    if not isinstance(doc, dict):
        return None, "not a JSON object"
    return doc, ""
