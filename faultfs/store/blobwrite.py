"""Writing into the tags' directories of the store: blob files (replaced whole through a
temporary file, or created straight under a free name), tag states, and a forgotten tag's
removal.

Invariants:
- A blob file is replaced atomically (temp file renamed into place, ``store/durable.py``);
  dirty blobs and tag states are fsynced, clean blobs need not be (a torn one fails
  verification and is faulted again).
- A blob is created in place (``put_new``) only under a free name, only clean, and only in a
  tag directory this process made or checked: nothing is written through a link, and a
  dirty blob is never replaced that way.
- A tag's directory is a real directory before anything is written into it: whatever else
  stands there (a link, a file) is removed first.
- ENOSPC and EDQUOT are StoreFull, with nothing partial left behind.
"""

from __future__ import annotations

import errno
import json
import os
import secrets

from faultfs.errors import StoreFull
from faultfs.store import direct
from faultfs.store.blobfile import FLAG_DIRTY, encode_header
from faultfs.store.durable import fsync_dir, write_atomic, write_parts
from faultfs.store.entries import (
    TAG_STATE,
    blob_path,
    make_real_dir,
    remove_entry,
    tag_dir,
    unlink_quietly,
)


class BlobWriter:
    """The store's writes into ``tags/`` (the caller checked the store can be written)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._real_dirs: set[str] = set()  # tag directories this process made or checked
        # new clean blobs of whole pages are written around the page cache (store.direct);
        # False: never (Config.store_direct), or once the file system refused it
        self.direct = True

    def put(self, tag: str, name: str, payload: bytes | memoryview, *, flags: int,
            source_version: str = "", durable: bool | None = None) -> int:
        """Stage ``payload`` as blob ``(tag, name)``; returns bytes written to disk.

        Clean blobs are written without fsync unless ``durable``: they can always be
        re-faulted, and a torn one fails verification. Dirty blobs are always fsynced.
        Raises StoreFull on ENOSPC/EDQUOT (nothing partial is left behind)."""
        header, with_payload = encode_header(tag, name, payload, flags=flags,
                                             source_version=source_version)
        self.make_tag_dir(tag)
        if durable is None:
            durable = bool(flags & FLAG_DIRTY)
        parts = [header, payload] if with_payload else [header]
        path = blob_path(self.root, tag, name)
        try:
            try:
                write_atomic(path, parts, mode=0o600, durable=durable)
            except IsADirectoryError:  # a foreign directory stands there: the blob replaces it
                remove_entry(path)
                write_atomic(path, parts, mode=0o600, durable=durable)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        return len(header) + (len(payload) if with_payload else 0)

    def put_new(self, tag: str, name: str, payload: bytes | memoryview, *, flags: int,
                source_version: str = "") -> int | None:
        """Stage a clean blob whose name is free, straight under its name: one create, a
        ``pwrite`` of the header and one of the payload (one ``pwritev`` around the page
        cache when the payload is page-aligned whole pages: ``store/direct.py``), one close —
        no temporary file, no rename, no fsync. None (nothing written) when the name is taken
        or the tag's directory was not made or checked by this store: the caller then
        decides (a dirty blob there is never replaced) and takes ``put``. A crash mid-write
        leaves a short or unsynced file, which fails verification like any unsynced clean
        blob and is faulted again."""
        directory = tag_dir(self.root, tag)
        if flags & FLAG_DIRTY or directory not in self._real_dirs:
            return None
        header, with_payload = encode_header(tag, name, payload, flags=flags,
                                             source_version=source_version)
        path = blob_path(self.root, tag, name)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            return None
        except FileNotFoundError:  # the directory went away: put() makes it again
            self._real_dirs.discard(directory)
            return None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        try:
            view = memoryview(payload)
            around = with_payload and self.direct and direct.aligned(view)
            if around and not direct.write_blob(fd, header, view):
                self.direct = around = False  # the file system refuses O_DIRECT: never again
            if not around:
                write_parts(fd, [header, payload] if with_payload else [header])
        except OSError as exc:
            os.close(fd)
            unlink_quietly(path)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        os.close(fd)
        return len(header) + (len(payload) if with_payload else 0)

    def temp_path(self, tag: str) -> str:
        """A fresh temporary name in ``tag``'s directory (made if needed) for ``publish``:
        the caller may record it first, so whoever finds it left by a crash removes it."""
        return os.path.join(self.make_tag_dir(tag), f"t-{secrets.token_hex(8)}.tmp")

    def publish(self, tag: str, name: str, payload: bytes | memoryview, tmp: str, *,
                source_version: str = "") -> int:
        """Stage a clean blob for readers in other processes: written whole to ``tmp``
        (``temp_path``), fsynced, renamed over the blob's name, so a reader opens the whole
        verified blob or none (DESIGN §18). The directory is not fsynced: after a power loss
        the blob is absent or whole. StoreFull on ENOSPC/EDQUOT; nothing partial stays."""
        header, with_payload = encode_header(tag, name, payload, flags=0,
                                             source_version=source_version)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                write_parts(fd, [header, payload] if with_payload else [header])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, blob_path(self.root, tag, name))
        except OSError as exc:
            unlink_quietly(tmp)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StoreFull(f"store {self.root} is full") from None
            raise
        except BaseException:
            unlink_quietly(tmp)
            raise
        return len(header) + (len(payload) if with_payload else 0)

    def write_tag_state(self, tag: str, state: dict) -> None:
        directory = self.make_tag_dir(tag)
        data = json.dumps(state, sort_keys=True, indent=1).encode()
        write_atomic(os.path.join(directory, TAG_STATE), [data], mode=0o600)

    def make_tag_dir(self, tag: str) -> str:
        """The tag's directory, made (0700) if needed; whatever else stands there (a link, a
        file) is removed first, so no write lands outside the store."""
        directory = tag_dir(self.root, tag)
        make_real_dir(directory)  # never a remove-then-make: another writer's blobs are in it
        self._real_dirs.add(directory)
        return directory

    def forget_tag(self, tag: str) -> None:
        """Remove a tag and every blob in it."""
        import shutil

        self._real_dirs.discard(tag_dir(self.root, tag))
        shutil.rmtree(tag_dir(self.root, tag), ignore_errors=True)
        fsync_dir(os.path.join(self.root, "tags"))
