"""Dirty blob files: written data folded out of the journal, one self-describing file per blob,
under ``<store>/writes/t-<tag>/b-<blob>``, and each tag's write state (``state.json``).

A dirty file is a blob file (``blobfile.py``) flagged dirty whose source-version field names
the journal position it includes (``wal:<seq>``): a replay applies only the records after it.
They live apart from staged clean blobs, so nothing that manages the cache (eviction, the
trusted scan at mount, a fault's store write) can touch user data.

A write that covers a whole chunk is written as a *direct file* ``t-<tag>/d-<seq, 16 hex>``
(the same format, naming ``wal:<seq>``) without fsync, and journaled as one small KIND_BLOB
record of that seq; the next fsync syncs it, and a fold renames it to ``b-<blob>`` (no copy).
Until then the ``b-`` file under it is kept: a power loss that tears the direct file finds
the record's checksum wrong and the replay stops there, before the blob's older state.

Invariants:
- Files are replaced whole and durably (temp file, fsync, rename, directory fsync), through a
  ``FileOps`` (so the crash tests cover them): after a crash a blob is its old file or its
  new one, never a mix.
- A read verifies the header and every block it returns; a damaged dirty file is a
  CorruptionError (EIO to readers), never re-faulted or replaced silently. So is anything
  but a regular file (a FIFO, a directory, a link) where a dirty file should be.
- A direct file is never written in place, and is deleted only when no record may name it
  any more (the journal was trimmed past it, or its blob was reset).
- Nothing is followed out of the store: a link (or a file) where a tag's directory should be
  holds no dirty data, and is replaced by a real directory before anything is written there;
  a linked ``writes`` or ``writes/journal`` refuses the mount.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import struct
from urllib.parse import unquote

from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.blobfile import (
    FLAG_DIRTY,
    HEADER_LEN,
    BlobHeader,
    decode_header,
    encode_header,
    payload_hash,
)
from faultfs.store.blobstore import encode_component
from faultfs.store.durable import write_parts
from faultfs.store.fileops import FileOps, OsFileOps, free_name, kept_dir
from faultfs.store.writestate import WriteState
from faultfs.store.writestate import encode as encode_state

WAL_PREFIX = "wal:"
DIRECT_PREFIX = "d-"  # d-<seq, 16 hex>: a chunk written whole, not folded yet
_PAYLOAD_XXH3 = struct.Struct("<Q")  # blob header bytes [32, 40): the payload's xxh3_64
log = logging.getLogger("faultfs.writes")


def entry_exists(path: str) -> bool:
    return os.path.isdir(path)
STATE = "state.json"
MAX_STATE = 1 << 20


def folded_seq(header: BlobHeader) -> int:
    """The last journal seq a dirty file includes (0 when it names none)."""
    text = header.source_version
    if text.startswith(WAL_PREFIX) and text[len(WAL_PREFIX):].isdigit():
        return int(text[len(WAL_PREFIX):])
    return 0


class DirtyFiles:
    """The dirty files of one store (blocking: file I/O)."""

    def __init__(self, root: str, ops: FileOps | None = None, *, writable: bool = True) -> None:
        self.root = os.path.join(root, "writes")
        self.ops = ops or OsFileOps(links=False, what="dirty file")
        self.writable = writable  # False: list and read only (a degraded or read-only store)
        self._ready: set[str] = set()  # tag directories checked and made by this process
        for directory in (self.root, os.path.join(self.root, "journal")):
            if os.path.islink(directory):
                raise InvalidInput(f"{directory} is a symbolic link: faultfs does not follow "
                                   "links inside its store")

    @staticmethod
    def _foreign(path: str) -> bool:
        """Something other than a real directory stands at ``path`` (a link, a file)."""
        try:
            return not stat.S_ISDIR(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False

    @staticmethod
    def _foreign_file(path: str) -> bool:
        try:
            return not stat.S_ISREG(os.lstat(path).st_mode)
        except FileNotFoundError:
            return False

    def _tag_dir_for_reading(self, tag: str) -> str | None:
        directory = self.tag_dir(tag)
        if self._foreign(directory):
            log.warning("%s is not a directory (a link or a file): it holds no writes of tag "
                        "%s", directory, tag)
            return None
        return directory

    def _tag_dir_for_writing(self, directory: str) -> None:
        if self._foreign(directory):
            log.warning("%s is not a directory: replaced by one (a link's target is left "
                        "alone)", directory)
            os.unlink(directory)
        self.ops.makedirs(directory)

    def _open_file(self, path: str, what: str) -> int:
        """A dirty file or write state, opened for reading; CorruptionError when something
        else stands there."""
        if os.path.islink(path):
            raise CorruptionError(f"{what} {path} is a symbolic link, not a file")
        try:
            return self.ops.open(path, os.O_RDONLY)
        except InvalidInput as exc:
            raise CorruptionError(f"{what} {path} is damaged ({exc.message})") from None

    def tag_dir(self, tag: str) -> str:
        return os.path.join(self.root, encode_component("t-", tag))

    def path(self, tag: str, name: str) -> str:
        return os.path.join(self.tag_dir(tag), encode_component("b-", name))

    # -- blobs -------------------------------------------------------------------------------

    def write(self, tag: str, name: str, payload: bytes | memoryview, seq: int, *,
              sync_dir: bool = True) -> int:
        """Replace blob ``name`` of ``tag`` with ``payload``, durably (``sync_dir=False``:
        the file is synced, its rename is made durable by ``sync_dirs`` later); bytes
        written."""
        header, with_payload = encode_header(tag, name, payload, flags=FLAG_DIRTY,
                                             source_version=f"{WAL_PREFIX}{seq}")
        parts = [header, payload] if with_payload else [header]
        self._replace(self.path(tag, name), parts, sync_dir=sync_dir)
        return len(header) + (len(payload) if with_payload else 0)

    # -- direct files (whole-chunk writes) ---------------------------------------------------

    def direct_path(self, tag: str, seq: int) -> str:
        return os.path.join(self.tag_dir(tag), f"{DIRECT_PREFIX}{seq:016x}")

    def write_direct(self, tag: str, name: str, payload: bytes | memoryview, seq: int) -> int:
        """Write ``payload`` as the direct file of ``seq`` (a new file, not synced: a kill -9
        keeps it, ``sync_files`` makes it durable); the payload's xxh3_64, for its record."""
        directory = self.tag_dir(tag)
        if directory not in self._ready:  # a lstat and a mkdir once per tag, not per write
            self._tag_dir_for_writing(directory)
            self._ready.add(directory)
        header, with_payload = encode_header(tag, name, payload, flags=FLAG_DIRTY,
                                             source_version=f"{WAL_PREFIX}{seq}")
        path = self.direct_path(tag, seq)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        try:
            fd = self.ops.open(path, flags)
        except FileExistsError:  # left by a crash before its record: no record names it
            self.ops.unlink(path)
            fd = self.ops.open(path, flags)
        try:
            try:  # the header is HEADER_LEN bytes: the payload follows it
                write_parts(fd, [header, payload] if with_payload else [header], self.ops.pwrite)
            finally:
                self.ops.close(fd)
        except BaseException:
            try:
                self.ops.unlink(path)
            except OSError:
                pass
            raise
        return int(_PAYLOAD_XXH3.unpack_from(header, 32)[0])  # 0 for an all-zero payload

    def sync_files(self, paths: list[str]) -> None:
        """fsync each file of ``paths`` (direct files written since the last sync; one
        deleted meanwhile — its blob was reset — needs none)."""
        for path in paths:
            try:
                fd = self.ops.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                self.ops.fsync(fd)
            finally:
                self.ops.close(fd)

    def check_direct(self, tag: str, name: str, seq: int, length: int, digest: int) -> bool:
        """Whether the direct file of ``seq`` holds blob ``name`` of ``tag`` whole, as its
        record says (length, payload checksum, every block): False when it is missing, torn
        or anything else (a power loss before it was synced)."""
        path = self.direct_path(tag, seq)
        if not self.ops.exists(path) or os.path.islink(path):
            return False
        try:
            fd = self.ops.open(path, os.O_RDONLY)
        except (OSError, InvalidInput):
            return False
        try:
            size = self.ops.size(fd)
            h = decode_header(self.ops.pread(fd, HEADER_LEN, 0), file_size=size)
            if (h.tag != tag or h.name != name or not h.dirty or h.payload_len != length
                    or h.source_version != f"{WAL_PREFIX}{seq}" or h.payload_xxh3 != digest):
                return False
            if h.all_zero:
                return True  # nothing stored: the header (checksummed) is the whole file
            data = self.ops.pread(fd, h.stored_len, HEADER_LEN)
            if len(data) != h.stored_len or payload_hash(data) != digest:
                return False
            h.check_blocks(0, data)
        except (CorruptionError, OSError):
            return False
        finally:
            self.ops.close(fd)
        return True

    def read_direct(self, tag: str, name: str, seq: int, off: int, size: int) -> bytes:
        """Verified payload bytes of the direct file of ``seq`` (as ``read``)."""
        return self._read(self.direct_path(tag, seq), tag, name, off, size)

    def adopt_direct(self, tag: str, name: str, seq: int) -> None:
        """Make the (synced) direct file of ``seq`` blob ``name``'s dirty file: a rename; its
        directory is synced by ``sync_dirs``."""
        path = self.path(tag, name)
        if self._foreign_file(path):  # a rename cannot replace a directory: move it aside
            aside = f"{path}.foreign-{secrets.token_hex(4)}"
            log.warning("%s is not a regular file: moved to %s", path, aside)
            os.rename(path, aside)
        self.ops.rename(self.direct_path(tag, seq), path)

    def delete_direct(self, tag: str, seq: int) -> None:
        path = self.direct_path(tag, seq)
        if self.ops.exists(path):
            self.ops.unlink(path)

    def set_aside_direct(self, tag: str, seq: int, directory: str) -> str | None:
        """Move the direct file of ``seq`` into ``directory`` (``writes/damaged/``: its record
        was set aside by a replay, so no replay names it again); its new name."""
        path = self.direct_path(tag, seq)
        if self._foreign_file(path) or not self.ops.exists(path):
            return None  # nothing, or not a file we wrote: left where it is
        kept_dir(self.ops, directory)
        name = free_name(self.ops, directory,
                         f"{os.path.basename(self.tag_dir(tag))}.{os.path.basename(path)}")
        fd = self.ops.open(path, os.O_RDONLY)  # written, maybe never synced: kept whole
        try:
            self.ops.fsync(fd)
        finally:
            self.ops.close(fd)
        self.ops.rename(path, os.path.join(directory, name))
        self.ops.fsync_dir(directory)
        self.ops.fsync_dir(os.path.dirname(path))
        return name

    def direct_seqs(self, tag: str) -> list[int]:
        """Seqs of the direct files of ``tag`` on disk."""
        directory = self._tag_dir_for_reading(tag)
        if directory is None:
            return []
        out = []
        for entry in self.ops.listdir(directory):
            digits = entry[len(DIRECT_PREFIX):]
            if entry.startswith(DIRECT_PREFIX) and len(digits) == 16:
                try:
                    out.append(int(digits, 16))
                except ValueError:
                    continue
        return sorted(out)

    def sync_dirs(self, tags: list[str]) -> None:
        """Make the renames of files written with ``sync_dir=False`` durable."""
        for tag in tags:
            self.ops.fsync_dir(self.tag_dir(tag))

    def _replace(self, path: str, parts: list[bytes | bytearray | memoryview], *,
                 sync_dir: bool = True) -> None:
        """Replace ``path`` with the concatenation of ``parts`` (written one after another,
        never joined: a fold's payload is not copied again), durably."""
        directory = os.path.dirname(path)
        self._tag_dir_for_writing(directory)
        if self._foreign_file(path):  # a rename cannot replace a directory: move it aside
            aside = f"{path}.foreign-{secrets.token_hex(4)}"
            log.warning("%s is not a regular file: moved to %s", path, aside)
            os.rename(path, aside)
        tmp = os.path.join(directory, f"t-{secrets.token_hex(8)}.tmp")
        fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                write_parts(fd, parts, self.ops.pwrite)
                self.ops.fsync(fd)
            finally:
                self.ops.close(fd)
            self.ops.rename(tmp, path)
        except BaseException:
            try:
                self.ops.unlink(tmp)
            except OSError:
                pass
            raise
        if sync_dir:
            self.ops.fsync_dir(directory)

    def header(self, tag: str, name: str, owners: tuple[str, ...] = ()) -> BlobHeader | None:
        """The verified header of a dirty file; None when absent. CorruptionError if damaged.
        ``owners``: the tags the file may have been written by (a clone's ancestors)."""
        if self._tag_dir_for_reading(tag) is None:
            return None
        path = self.path(tag, name)
        if not self.ops.exists(path) and not os.path.islink(path):
            return None
        fd = self._open_file(path, f"dirty blob {name} of tag {tag}")
        try:
            header = decode_header(self.ops.pread(fd, HEADER_LEN, 0), file_size=self.ops.size(fd))
        except CorruptionError as exc:
            raise CorruptionError(f"dirty blob {name} of tag {tag} is damaged ({exc}): {path}") from None
        finally:
            self.ops.close(fd)
        if header.tag not in (tag, *owners) or header.name != name or not header.dirty:
            raise CorruptionError(f"dirty blob {name} of tag {tag} is damaged (it holds "
                                  f"{header.name!r} of {header.tag!r}): {path}")
        return header

    def read(self, tag: str, name: str, off: int, size: int) -> bytes:
        """Verified payload bytes ``[off, off+size)`` (clipped to the payload)."""
        return self._read(self.path(tag, name), tag, name, off, size)

    def _read(self, path: str, tag: str, name: str, off: int, size: int) -> bytes:
        fd = self._open_file(path, f"dirty blob {name} of tag {tag}")
        try:
            raw = self.ops.pread(fd, HEADER_LEN, 0)
            try:
                h = decode_header(raw, file_size=self.ops.size(fd))
            except CorruptionError as exc:
                raise CorruptionError(f"dirty blob {name} of tag {tag} is damaged ({exc})") from None
            if off >= h.payload_len or size <= 0:
                return b""
            size = min(size, h.payload_len - off)
            if h.all_zero:
                return bytes(size)
            first, last = h.blocks_for(off, size)
            start = first * h.block_size
            want = min(last * h.block_size, h.stored_len) - start
            data = self.ops.pread(fd, want, HEADER_LEN + start)
            if len(data) != want:
                raise CorruptionError(f"dirty blob {name} of tag {tag} is truncated: {path}")
            h.check_blocks(first, data)
            return bytes(data[off - start:off - start + size])
        finally:
            self.ops.close(fd)

    def names(self, tag: str, *, sweep: bool = True) -> list[str]:
        """Names of the dirty files of ``tag`` (from their headers, for hashed names).
        ``sweep``: delete the temporary files of replacements that never finished — only
        when nothing writes the tag's files (a mount opening it): a fold's or a state
        save's under way is one too."""
        directory = self._tag_dir_for_reading(tag)
        if directory is None:
            return []
        out = []
        for entry in self.ops.listdir(directory):
            if entry.startswith("b-"):
                out.append(unquote(entry[2:]))
            elif entry.startswith("h-"):
                try:
                    fd = self._open_file(os.path.join(directory, entry), "dirty file")
                except CorruptionError as exc:
                    log.error("%s: kept", exc)
                    continue
                try:
                    out.append(decode_header(self.ops.pread(fd, HEADER_LEN, 0)).name)
                except CorruptionError:
                    continue
                finally:
                    self.ops.close(fd)
            elif entry.startswith("t-") and entry.endswith(".tmp") and self.writable and sweep:
                self.ops.unlink(os.path.join(directory, entry))  # never renamed: never valid
        return sorted(out)

    def delete(self, tag: str, name: str) -> None:
        path = self.path(tag, name)
        if self.ops.exists(path):
            self.ops.unlink(path)
            self.ops.fsync_dir(os.path.dirname(path))

    def link_from(self, src_tag: str, tag: str) -> list[str]:
        """Hard-link every dirty file of ``src_tag`` into ``tag`` (a clone: the files are
        replaced, never written in place, so a link is a snapshot); the names linked."""
        names = self.names(src_tag, sweep=False)  # (the parent is written meanwhile)
        self._tag_dir_for_writing(self.tag_dir(tag))
        for name in names:
            os.link(self.path(src_tag, name), self.path(tag, name))
        self.ops.fsync_dir(self.tag_dir(tag))
        return names

    def forget_tag(self, tag: str) -> None:
        """Remove every dirty file and the write state of ``tag``."""
        directory = self.tag_dir(tag)
        self._ready.discard(directory)
        if self._foreign(directory):
            os.unlink(directory)  # a link: never what it points to
            return
        for entry in self.ops.listdir(directory):
            self.ops.unlink(os.path.join(directory, entry))
        if self.ops.exists(directory) or entry_exists(directory):
            os.rmdir(directory)
            self.ops.fsync_dir(self.root)

    def tags(self) -> list[str]:
        """Tags that have a directory of dirty files or a write state."""
        return sorted(unquote(e[2:]) for e in self.ops.listdir(self.root) if e.startswith("t-"))

    # -- per-tag write state -----------------------------------------------------------------

    def read_state(self, tag: str) -> object:
        """The tag's write state document ({} when it has none; ``WriteState.parse`` reads
        it, and says what is wrong with one that is no write state); CorruptionError when it
        is not JSON, or cannot be read."""
        directory = self._tag_dir_for_reading(tag)
        if directory is None:
            return {}
        path = os.path.join(directory, STATE)
        if not self.ops.exists(path) and not os.path.islink(path):
            return {}
        fd = self._open_file(path, "write state")
        try:
            raw = self.ops.pread(fd, MAX_STATE, 0)
        finally:
            self.ops.close(fd)
        try:
            doc = json.loads(raw)
        except ValueError:
            raise CorruptionError(f"write state {path} is not valid JSON") from None
        return doc

    def write_state(self, tag: str, state: WriteState) -> None:
        """Replace the tag's write state, durably (``store/writestate.py`` is its format)."""
        self._replace(os.path.join(self.tag_dir(tag), STATE), [encode_state(state)])
