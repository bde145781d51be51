"""How the store names and meets its entries: every file name derived by encoding (no tag or
blob name can escape its directory), every file opened without following a link or
blocking, and whatever stands where a store file should be removed, not followed.

Invariants:
- A path component of the store is ``encode_component``'s: percent-encoded, or
  ``h-<sha256>`` when too long (the file's header then says the name).
- ``open_regular`` opens regular files only (ForeignEntry for a link, a directory, a FIFO,
  a socket or a device), never blocking on a FIFO; ``remove_entry`` removes the entry itself,
  never what a link points to.
- Store directories are private to their owner (``PRIVATE``; files 0600).
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import stat as stat_mod
from urllib.parse import quote

MAX_ENCODED_NAME = 240  # NAME_MAX is 255: leave room for the "b-" prefix and margin
PRIVATE = 0o700  # the store names sources and tags: for its owner only (files 0600)
TAG_STATE = "tag.json"  # a tag's state, beside its blobs
# The file system refuses writes but the staged blobs can still be read: mount degraded.
DEGRADED_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


def encode_component(prefix: str, name: str) -> str:
    """A file name for ``name`` under ``prefix``: percent-encoded (no name can escape a
    directory), or ``h-<sha256>`` when too long (the header then says the name)."""
    encoded = quote(name, safe="")
    if len(encoded) > MAX_ENCODED_NAME:
        return "h-" + hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()
    return prefix + encoded


@functools.lru_cache(maxsize=256)  # a tag's blobs are found under it again and again
def tag_dir(root: str, tag: str) -> str:
    """The directory of ``tag``'s staged blobs in the store at ``root``."""
    return os.path.join(root, "tags", encode_component("t-", tag))


def blob_path(root: str, tag: str, name: str) -> str:
    """The file of blob ``name`` of ``tag`` in the store at ``root``."""
    return os.path.join(tag_dir(root, tag), encode_component("b-", name))


class ForeignEntry(Exception):
    """Something other than a regular file (a FIFO, a directory, a symbolic link, a device)
    stands where a store file should be."""


OPEN_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK  # see open_regular
FOREIGN_ERRNOS = (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EOPNOTSUPP)  # a link, a directory, a socket


def open_regular(path: str, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of the regular file ``path`` names, never following a symbolic link and
    never blocking (a FIFO's open would); None when it is absent. ForeignEntry for anything
    else, so no hostile entry in the store can hang a request or lead outside the store."""
    opened = open_regular_stat(path, flags)
    return None if opened is None else opened[0]


def open_regular_stat(path: str, flags: int = os.O_RDONLY
                      ) -> tuple[int, os.stat_result] | None:
    """``open_regular``, with the file's ``fstat`` (taken to check it is regular)."""
    try:
        fd = os.open(path, flags | OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in FOREIGN_ERRNOS:
            raise ForeignEntry(path) from None
        raise
    st = os.fstat(fd)
    if not stat_mod.S_ISREG(st.st_mode):
        os.close(fd)
        raise ForeignEntry(path)
    return fd, st


def remove_entry(path: str) -> None:
    """Remove whatever is at ``path`` (not what a link points to)."""
    try:
        if stat_mod.S_ISDIR(os.lstat(path).st_mode):
            import shutil

            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def make_real_dir(path: str) -> None:
    """Make directory ``path`` (and its parents, ``PRIVATE``) unless one stands there;
    whatever else stands there (a link, a file) is removed first. A directory is never
    removed: threads and processes making the same one at once all end with it, and with
    what the first of them already put in it."""
    try:
        if stat_mod.S_ISDIR(os.lstat(path).st_mode):
            return
        os.unlink(path)  # a link or a file: what a link points to is never followed
    except FileNotFoundError:
        pass
    os.makedirs(path, mode=PRIVATE, exist_ok=True)


def real_dir(path: str) -> bool:
    """Whether ``path`` is a directory itself (not a link to one)."""
    try:
        return stat_mod.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def tighten(path: str) -> None:
    """Make a store directory private (an older faultfs made them 0755)."""
    st = os.lstat(path)
    if st.st_uid == os.geteuid() and stat_mod.S_IMODE(st.st_mode) != PRIVATE:
        os.chmod(path, PRIVATE)


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
