"""Checking a store no mount owns: one streaming walk over every file of it (``StoreWalk``),
shared by ``fsck`` (verify, report, repair) and ``gc`` (``store/gc.py``: reclaim space).

What the walk looks at, area by area (the layout is in ``blobstore.py``, ``dirty.py`` and
``journal.py``):

- registry entries  ``tags/t-__cae_on_fault/b-fault:<hex>``: the blob file verifies and holds
  the canonical context whose key is its name; a tag is registered by one entry (the one its
  tag state names), and has a tag state.
- tag states and blobs  ``tags/t-<tag>/``: ``tag.json`` is a JSON object naming a fault key of
  the registry; every blob file verifies (header, tag and name, every block, the whole-payload
  checksum); a clean blob was staged from the tag state's source version (else *stale*); the
  blob ``pagemap`` parses (``core.pagemap.parse``). The blobs of a tag the registry does not
  know are *orphaned* (kept while a registered clone names the tag as its parent: they are
  that clone's clean chunks).
- writes  ``writes/t-<tag>/``: ``state.json`` (the write state) is a JSON object of the fields
  the engine reads; dirty files verify like blobs, are flagged dirty, name a journal position
  and belong to the tag or one of its ancestors (a clone's linked files); so do the direct
  files ``d-<seq>`` of whole-chunk writes not folded yet, which name their own seq.
- the journal  ``writes/journal/w-<seq>.log``: records verify in order, across segments, with
  rising seqs; a partial record at the end of the last segment is a *torn tail* (a crash while
  appending: the next mount cuts it off), a bad record anywhere else is damage.
- temp files  ``t-<hex>.tmp`` in a tag's or a write directory, ``.probe-*`` at the root: left by
  an interrupted write, never renamed into place, never valid.

Invariants:
- Memory is bounded by the number of *tags* (the registry, encoded directory names), never by
  the number of blobs: directories are streamed with ``scandir`` (the journal's segment names
  excepted: one per 64 MiB of it), payloads are read in pieces of at most ``READ_STEP``, and
  findings go to the caller as they are made.
- Nothing is changed unless the caller drops a finding (``StoreWalk.drop``); a finding with a
  ``keep`` reason — dirty data, write states, the journal, entries the walk does not know — is
  never dropped. A registry entry without a tag state is kept too: a mount recovers it.
- The store is locked (``StoreLock``) as a mount locks it (``BlobStore.acquire``), without ever
  waiting: a store a live mount owns is refused, and a mount started during the walk is
  refused by the lock instead of blocking on it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat as stat_mod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import unquote

import xxhash

from faultfs.core.context import REGISTRY_TAG, FaultContext, is_fault_key
from faultfs.core.pagemap import MAX_PAGEMAP_TEXT, parse
from faultfs.errors import CorruptionError, FaultfsError, InvalidInput
from faultfs.store.blobfile import HEADER_LEN, BlobHeader, decode_header
from faultfs.store.blobstore import (
    TAG_STATE,
    ForeignEntry,
    encode_component,
    open_regular,
    remove_entry,
)
from faultfs.store.dirty import DIRECT_PREFIX, WAL_PREFIX
from faultfs.store.dirty import STATE as WRITE_STATE
from faultfs.store.journal import (
    DAMAGED_DIR,
    HEAD_LEN,
    KIND_WRITE,
    SEGMENT_PREFIX,
    SEGMENT_SUFFIX,
    decode_head,
)

PAGEMAP_BLOB = "pagemap"  # DESIGN §2: a tag's pagemap is its blob "pagemap" (user data)
READ_STEP = 4 << 20  # payloads are verified in pieces of this much: memory stays flat
MAX_STATE_BYTES = 1 << 20  # a tag or write state larger than this is not one we wrote
MAX_CONTEXT_BYTES = 1 << 20  # as core.context: a registry entry larger is not ours
PROBE_PREFIX = ".probe-"  # BlobStore.create's writability probe, left by a crash

# Statuses of a finding.
OK, DAMAGED, STALE, ORPHANED = "ok", "damaged", "stale", "orphaned"
STATUSES = (OK, DAMAGED, STALE, ORPHANED)

# Areas: the rows of fsck's summary table.
REGISTRY = "registry entries"
TAG_STATES = "tag states"
BLOBS = "blobs"
PAGEMAPS = "pagemaps"
DIRTY = "dirty blobs"
WRITE_STATES = "write states"
JOURNAL = "journal segments"
TEMP = "temp files"
OTHER = "other entries"
AREAS = (REGISTRY, TAG_STATES, BLOBS, PAGEMAPS, DIRTY, WRITE_STATES, JOURNAL, TEMP, OTHER)

# Why a finding is never dropped.
KEEP_DIRTY = "dirty data"
KEEP_JOURNAL = "the journal"
KEEP_UNKNOWN = "not a file faultfs writes"
KEEP_RECOVERABLE = "a mount with its source recovers it"
KEEP_CLONED = "a registered clone reads its staged blobs"

# The write state's fields and their types, as ``engine/writes.py`` reads them.
WRITE_STATE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "view_size": int, "view_seq": int, "users": dict, "next_user": int, "ancestors": list,
    "voided": int, "voided_blobs": dict, "mtime_ns": int, "parted": list,
    "damaged_blobs": dict,
}


class StoreBusy(FaultfsError):
    """A live mount owns the store."""

    def __init__(self, message: str) -> None:
        super().__init__(message, errno.EBUSY)


@dataclass(slots=True)
class Finding:
    """One entry of the store and what the walk found it to be."""

    area: str
    status: str
    path: str  # absolute
    size: int = 0  # bytes of the entry on disk
    reason: str = ""  # what is wrong, naming the blob or tag ("" when it is ok)
    keep: str = ""  # why it is never dropped ("" when it may be)
    action: str = ""  # "dropped", "would drop", "kept" once the caller decided

    @property
    def problem(self) -> bool:
        return self.status != OK

    def describe(self, root: str) -> str:
        """One line: status, where, what is wrong, what was done."""
        where = os.path.relpath(self.path, root)
        if self.action in ("dropped", "would drop"):
            done = self.action
        elif self.keep:
            done = (f"kept: {self.keep}" if self.action == "kept"
                    else f"--repair keeps it: {self.keep}")
        else:
            done = "--repair drops it"
        return f"{self.status:<8}  {where}: {self.reason} [{done}]"

    def to_doc(self, root: str) -> dict:
        return {"status": self.status, "area": self.area,
                "path": os.path.relpath(self.path, root), "reason": self.reason,
                "bytes": self.size, "keep": self.keep, "action": self.action}


# -- the lock ---------------------------------------------------------------------------------

class StoreLock:
    """The store's lock file, ``flock``ed the way ``BlobStore.acquire`` does and never waited
    for: StoreBusy (one line) when a live mount holds it. Held for the walk, so a mount
    started meanwhile is refused at once rather than blocked. Writes its pid when it can (a
    refused mount then names this process)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, "lock")
        self._fd = -1

    def __enter__(self) -> StoreLock:
        fd, writable = self._open()
        if fd is None:
            return self  # a read-only store without a lock file: nothing can own it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise StoreBusy(f"store {self.root} is in use by pid {owner} (a live mount owns "
                            "it, or another fsck or gc runs): unmount it first") from None
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> tuple[int | None, bool]:
        try:
            try:
                fd = open_regular(self.path, os.O_RDWR)
                if fd is not None:
                    return fd, True
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
                               | os.O_NOFOLLOW, 0o600), True
            except FileExistsError:  # a mount made it a moment ago
                return open_regular(self.path, os.O_RDWR), True
            except OSError as exc:
                if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise
            return open_regular(self.path, os.O_RDONLY), False
        except ForeignEntry:
            raise InvalidInput(f"store lock {self.path} is not a regular file",
                               errno.EEXIST) from None

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


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


# -- the walk ---------------------------------------------------------------------------------

def _real_dir(path: str) -> bool:
    try:
        return stat_mod.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _scan(path: str) -> Iterator[os.DirEntry]:
    """The entries of directory ``path``, streamed; none when it is absent or not a real
    directory (a link to one is never followed: nothing outside the store is looked at, let
    alone removed)."""
    if not _real_dir(path):
        return
    try:
        it = os.scandir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    with it:
        yield from it


def _direct_seq(name: str) -> int | None:
    """The seq a direct file's name (``d-<16 hex>``) gives, None for any other name."""
    digits = name[len(DIRECT_PREFIX):]
    if not name.startswith(DIRECT_PREFIX) or len(digits) != 16:
        return None
    try:
        return int(digits, 16)
    except ValueError:
        return None


def _is_temp(name: str) -> bool:
    return name.startswith("t-") and name.endswith(".tmp")


def _kind(mode: int) -> str:
    for test, what in ((stat_mod.S_ISDIR, "a directory"), (stat_mod.S_ISLNK, "a symbolic link"),
                       (stat_mod.S_ISFIFO, "a FIFO"), (stat_mod.S_ISSOCK, "a socket"),
                       (stat_mod.S_ISCHR, "a device"), (stat_mod.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a regular file"


def _lsize(path: str) -> tuple[int, int]:
    """``(mode, bytes)`` of the entry itself (a directory counts what is under it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0, 0
    if stat_mod.S_ISDIR(st.st_mode):
        return st.st_mode, sum(s for _, s in _tree_sizes(path))
    return st.st_mode, st.st_size


def _tree_sizes(path: str) -> Iterator[tuple[str, int]]:
    """``(path, bytes)`` of every non-directory under ``path``, streamed, links not followed."""
    for entry in _scan(path):
        try:
            if entry.is_dir(follow_symlinks=False):
                yield from _tree_sizes(entry.path)
            else:
                yield entry.path, entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            continue


def measure(root: str) -> tuple[int, int]:
    """``(files, bytes)`` under the store's ``tags`` and ``writes``: the total a progress bar
    counts towards (one ``stat`` per file, no file is opened; streamed)."""
    files = total = 0
    for sub in ("tags", "writes"):
        for _, size in _tree_sizes(os.path.join(root, sub)):
            files += 1
            total += size
    return files, total


@dataclass
class _Blob:
    """What reading one blob file found."""

    header: BlobHeader | None
    problem: str = ""  # "" when it verifies
    foreign: bool = False  # not a regular file: no data at all
    payload: bytes | None = None  # the payload, when it was asked for and verifies


@dataclass
class _Registered:
    """The registry as the walk uses it: bounded by the number of tags."""

    by_tag: dict[str, list[str]] = field(default_factory=dict)  # tag -> keys registering it
    dirs: dict[str, str] = field(default_factory=dict)  # encoded directory name -> tag
    parents: set[str] = field(default_factory=set)  # keys registered clones were cloned from


class StoreWalk:
    """Every entry of the store, verified and classified, as a stream of ``Finding``s.

    ``verify``: read every payload and check every block, the whole-payload checksum and the
    pagemap (fsck); without it only headers are read (gc). The caller may ``drop`` each
    finding as it receives it; an orphaned tag's emptied directory then goes too."""

    def __init__(self, root: str, *, verify: bool = True) -> None:
        self.root = root
        self.verify = verify
        self._tags = os.path.join(root, "tags")
        self._writes = os.path.join(root, "writes")
        self._registry_dir = encode_component("t-", REGISTRY_TAG)
        self._known = _Registered()
        self._pruning = False  # something was dropped: emptied orphaned directories go too
        self._buf = bytearray()  # grown to the largest piece read, at most READ_STEP

    def __iter__(self) -> Iterator[Finding]:
        yield from self._registry_pass()
        yield from self._tags_pass()
        yield from self._writes_pass()
        yield from self._root_pass()

    def drop(self, finding: Finding, *, dry_run: bool = False) -> int:
        """Remove the entry of ``finding`` (whatever it is, never following a link); the bytes
        it held. ``dry_run``: only say so."""
        if finding.keep:
            raise ValueError(f"{finding.path} is kept: {finding.keep}")
        if dry_run:
            finding.action = "would drop"
            return finding.size
        remove_entry(finding.path)
        finding.action = "dropped"
        self._pruning = True
        return finding.size

    def _prune(self, directory: str) -> None:
        if self._pruning:
            try:
                os.rmdir(directory)
            except OSError:
                pass  # not empty: something in it is kept

    # -- blob files ---------------------------------------------------------------------------

    def _read_blob(self, path: str, *, owners: Callable[[str], bool], name: str | None,
                   keep_payload: int = 0, verify: bool | None = None) -> _Blob:
        """Read and verify one blob file. ``owners(tag)``: whether the header's tag may own
        it; ``name``: the blob it must hold (None: any, for a hashed file name, checked by
        the caller); ``keep_payload``: return payloads up to this size."""
        verify = self.verify if verify is None else verify
        try:
            fd = open_regular(path)
        except ForeignEntry:
            mode, _ = _lsize(path)
            return _Blob(None, f"{_kind(mode)} stands where a blob file should be", foreign=True)
        if fd is None:
            return _Blob(None, "vanished while it was checked")
        try:
            size = os.fstat(fd).st_size
            try:
                header = decode_header(os.pread(fd, HEADER_LEN, 0), file_size=size)
            except CorruptionError as exc:
                return _Blob(None, exc.message)
            if not owners(header.tag):
                return _Blob(header, f"holds a blob of tag {header.tag!r}")
            if name is not None and header.name != name:
                return _Blob(header, f"holds blob {header.name!r}")
            if not verify:
                return _Blob(header)
            return self._verify_payload(fd, header, keep_payload)
        finally:
            os.close(fd)

    def _verify_payload(self, fd: int, header: BlobHeader, keep_payload: int) -> _Blob:
        keep = header.payload_len <= keep_payload
        if header.all_zero:
            return _Blob(header, payload=bytes(header.payload_len) if keep else None)
        block = header.block_size
        step = max(block, READ_STEP // block * block)
        need = min(step, header.stored_len)
        if len(self._buf) < need:
            self._buf = bytearray(need)
        view = memoryview(self._buf)
        digest = xxhash.xxh3_64()
        kept = bytearray() if keep else None
        off = 0
        while off < header.stored_len:
            want = min(step, header.stored_len - off)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], HEADER_LEN + off + got)
                if n == 0:
                    return _Blob(header, "is shorter than its header says")
                got += n
            piece = view[:want]
            try:
                header.check_blocks(off // block, piece)
            except CorruptionError as exc:
                return _Blob(header, exc.message.split(": ", 1)[-1])
            digest.update(piece)
            if kept is not None:
                kept += piece
            off += want
        if digest.intdigest() != header.payload_xxh3:
            return _Blob(header, "payload checksum mismatch")
        return _Blob(header, payload=bytes(kept) if kept is not None else None)

    @staticmethod
    def _blob_name(entry_name: str) -> tuple[str | None, bool]:
        """``(name, hashed)`` a blob file's name says; name None for a hashed name (the header
        says it) or for a name the store would never look up (not canonically encoded)."""
        if entry_name.startswith("h-"):
            return None, True
        name = unquote(entry_name[2:])
        return (name if encode_component("b-", name) == entry_name else None), False

    # -- the registry -------------------------------------------------------------------------

    def _registry_pass(self) -> Iterator[Finding]:
        """Every registry entry, read whole (they are small): which tags are registered, under
        which keys. Findings are held until the pass ends: a tag registered twice is only
        known then (one finding per tag: bounded by the number of tags)."""
        directory = os.path.join(self._tags, self._registry_dir)
        held: list[tuple[Finding, str, FaultContext]] = []  # (finding, key, ctx): usable ones
        out: list[Finding] = []
        if os.path.lexists(directory) and not _real_dir(directory):
            mode, size = _lsize(directory)  # the store sees no registry either (and replaces it)
            out.append(Finding(REGISTRY, DAMAGED, directory, size,
                               f"{_kind(mode)} stands where the registry's directory should be"))
        for entry in _scan(directory):
            path = entry.path
            if _is_temp(entry.name):
                out.append(self._temp(path))
                continue
            if not entry.name.startswith(("b-", "h-")):
                out.append(self._unknown(path))
                continue
            name, hashed = self._blob_name(entry.name)
            if name is None and not hashed:
                out.append(self._unknown(path))
                continue
            _, size = _lsize(path)
            blob = self._read_blob(path, owners=lambda t: t == REGISTRY_TAG, name=name,
                                   keep_payload=MAX_CONTEXT_BYTES, verify=True)
            if hashed and blob.header is not None and not blob.problem and (
                    encode_component("b-", blob.header.name) != entry.name):
                blob.problem = f"holds blob {blob.header.name!r}, which is not named so"
            key = name or (blob.header.name if blob.header is not None else entry.name)
            subject = f"registry entry {key}"
            if blob.problem:
                out.append(Finding(REGISTRY, DAMAGED, path, size, f"{subject}: {blob.problem}"))
                continue
            if not is_fault_key(key):
                out.append(Finding(REGISTRY, ORPHANED, path, size,
                                   f"{subject}: not a fault key (a mount never reads it)"))
                continue
            assert blob.payload is not None
            try:
                ctx = FaultContext.decode(blob.payload)
            except InvalidInput as exc:
                out.append(Finding(REGISTRY, DAMAGED, path, size,
                                   f"{subject}: not a fault context ({exc.message})"))
                continue
            if ctx.key != key:
                out.append(Finding(REGISTRY, DAMAGED, path, size,
                                   f"{subject}: holds the context of {ctx.key}"))
                continue
            held.append((Finding(REGISTRY, OK, path, size), key, ctx))
            self._known.by_tag.setdefault(ctx.dst, []).append(key)
        for finding, key, ctx in held:
            tag = ctx.dst
            keys = self._known.by_tag[tag]
            state_key = self._state_key(tag)
            if len(keys) > 1 and state_key in keys and key != state_key:
                finding.status = ORPHANED
                finding.reason = (f"registry entry {key}: tag {tag} is registered again by "
                                  f"{state_key}, the context its tag state names")
            elif state_key is None:
                finding.status = ORPHANED
                finding.keep = KEEP_RECOVERABLE
                finding.reason = f"registry entry {key}: tag {tag} has no tag state"
            if ctx.cloned_from is not None and (finding.status == OK or finding.keep):
                self._known.parents.add(ctx.cloned_from)
            out.append(finding)
        for tag, keys in self._known.by_tag.items():
            state_key = self._state_key(tag)
            if len(keys) > 1 and state_key in keys:
                keys[:] = [state_key]
            self._known.dirs[encode_component("t-", tag)] = tag
        yield from out

    def _state_key(self, tag: str) -> str | None:
        """The key a tag's state names: "" when the state is there but unusable, None when
        there is none."""
        path = os.path.join(self._tags, encode_component("t-", tag), TAG_STATE)
        if not os.path.lexists(path):
            return None
        doc, _ = self._read_json(path)
        key = doc.get("key") if doc is not None else None
        return key if isinstance(key, str) else ""

    # -- tags ---------------------------------------------------------------------------------

    def _tag_of(self, dirname: str) -> str | None:
        """The tag a directory of ``tags/`` or ``writes/`` is for; None when unknown (a hashed
        name no registered tag has, or a name the store would never make)."""
        tag = self._known.dirs.get(dirname)
        if tag is not None or not dirname.startswith("t-"):
            return tag
        tag = unquote(dirname[2:])
        return tag if encode_component("t-", tag) == dirname else None

    def _tags_pass(self) -> Iterator[Finding]:
        for entry in _scan(self._tags):
            if entry.name == self._registry_dir:
                continue
            tag = self._tag_of(entry.name)
            is_store_name = entry.name.startswith(("t-", "h-"))
            if not entry.is_dir(follow_symlinks=False):
                if is_store_name:  # a file, link or FIFO where a tag's directory should be
                    mode, size = _lsize(entry.path)
                    yield Finding(TAG_STATES, DAMAGED, entry.path, size,
                                  f"{_kind(mode)} stands where the directory of tag "
                                  f"{tag or entry.name} should be")
                else:
                    yield self._unknown(entry.path)
                continue
            if not is_store_name or (tag is None and entry.name.startswith("t-")):
                yield self._unknown(entry.path)
                continue
            yield from self._tag_dir(entry.path, entry.name, tag)

    def _tag_dir(self, directory: str, dirname: str, tag: str | None) -> Iterator[Finding]:
        label = tag if tag is not None else dirname
        keys = self._known.by_tag.get(tag, []) if tag is not None else []
        state_path = os.path.join(directory, TAG_STATE)
        state_doc: dict | None = None
        state_problem = ""
        if os.path.lexists(state_path):
            state_doc, state_problem = self._read_json(state_path)
            if state_doc is not None and not is_fault_key(str(state_doc.get("key"))):
                state_problem = "names no fault key"
        orphan = ""
        if not keys:
            orphan = f"tag {label} has no registry entry"
        elif state_doc is not None and not state_problem and state_doc["key"] not in keys:
            orphan = (f"tag {label} was staged for context {state_doc['key']}, but it is "
                      f"registered as {keys[0]}")
        kept = ""
        if orphan and state_doc is not None and not state_problem and (
                state_doc["key"] in self._known.parents):
            kept = KEEP_CLONED
        version: str | None = None
        if state_doc is not None and not state_problem and not orphan:
            found = state_doc.get("source_version")
            version = found if isinstance(found, str) else None
        if os.path.lexists(state_path):
            _, size = _lsize(state_path)
            subject = f"tag state of {label}"
            if state_problem:
                yield Finding(TAG_STATES, DAMAGED, state_path, size, f"{subject}: {state_problem}")
            elif orphan:
                yield Finding(TAG_STATES, ORPHANED, state_path, size, f"{subject}: {orphan}",
                              kept)
            else:
                yield Finding(TAG_STATES, OK, state_path, size)

        def owns(header_tag: str) -> bool:
            return header_tag == tag if tag is not None else (
                encode_component("t-", header_tag) == dirname)

        for entry in _scan(directory):
            if entry.name == TAG_STATE:
                continue
            if _is_temp(entry.name):
                yield self._temp(entry.path)
            elif entry.name.startswith(("b-", "h-")):
                yield self._staged(entry, label, owns, version, orphan, kept)
            else:
                yield self._unknown(entry.path)
        if orphan:
            self._prune(directory)

    def _staged(self, entry: os.DirEntry, label: str, owns: Callable[[str], bool],
                version: str | None, orphan: str, kept: str = "") -> Finding:
        """One blob file of a tag's directory: clean (staged), or the dirty pagemap."""
        path = entry.path
        name, hashed = self._blob_name(entry.name)
        if name is None and not hashed:
            return self._unknown(path)
        _, size = _lsize(path)
        pagemap = name == PAGEMAP_BLOB
        blob = self._read_blob(path, owners=owns, name=name,
                               keep_payload=MAX_PAGEMAP_TEXT if pagemap else 0)
        header = blob.header
        if hashed and header is not None and not blob.problem:
            name = header.name
            if encode_component("b-", name) != entry.name:
                blob.problem = f"holds blob {name!r}, which is not named so"
        subject = f"blob {name or entry.name} of tag {label}"
        dirty = pagemap or (header is not None and header.dirty)
        area = PAGEMAPS if pagemap else DIRTY if dirty else BLOBS
        if blob.problem:  # a damaged pagemap is kept: it is user data (a FIFO holds none)
            keep = KEEP_DIRTY if dirty and not blob.foreign else ""
            return Finding(area, DAMAGED, path, size, f"{subject}: {blob.problem}", keep)
        assert header is not None
        if dirty:
            if pagemap and self.verify:
                problem = (_pagemap_problem(blob.payload) if blob.payload is not None
                           else f"{header.payload_len} bytes, over {MAX_PAGEMAP_TEXT}")
                if problem:
                    return Finding(area, DAMAGED, path, size, f"pagemap of tag {label}: {problem}",
                                   KEEP_DIRTY)
            if orphan:
                return Finding(area, ORPHANED, path, size, f"{subject}: {orphan}", KEEP_DIRTY)
            return Finding(area, OK, path, size)
        if orphan:
            return Finding(area, ORPHANED, path, size, f"{subject}: {orphan}", kept)
        if version is not None and header.source_version != version:
            return Finding(area, STALE, path, size,
                           f"{subject}: staged from source version {header.source_version!r}, "
                           f"the tag's is {version!r}")
        return Finding(area, OK, path, size)

    # -- writes -------------------------------------------------------------------------------

    def _writes_pass(self) -> Iterator[Finding]:
        if os.path.lexists(self._writes) and not _real_dir(self._writes):
            mode, size = _lsize(self._writes)
            yield Finding(WRITE_STATES, DAMAGED, self._writes, size,
                          f"{_kind(mode)} stands where the writes' directory should be",
                          KEEP_DIRTY)
            return
        for entry in _scan(self._writes):
            if entry.name == DAMAGED_DIR and entry.is_dir(follow_symlinks=False):
                for kept in _scan(entry.path):
                    _, size = _lsize(kept.path)
                    yield Finding(JOURNAL, DAMAGED, kept.path, size,
                                  "kept by a mount: writes it could not replay or fold (see the "
                                  "store's log); remove it by hand once not needed",
                                  KEEP_JOURNAL)
                continue
            if entry.name == "journal":
                if entry.is_dir(follow_symlinks=False):
                    yield from self._journal(entry.path)
                else:
                    mode, size = _lsize(entry.path)
                    yield Finding(JOURNAL, DAMAGED, entry.path, size,
                                  f"{_kind(mode)} stands where the journal's directory should be",
                                  KEEP_JOURNAL)
                continue
            tag = self._tag_of(entry.name)
            if not entry.name.startswith(("t-", "h-")) or (tag is None and entry.name.startswith("t-")):
                yield self._unknown(entry.path)
            elif not entry.is_dir(follow_symlinks=False):
                mode, size = _lsize(entry.path)
                yield Finding(WRITE_STATES, DAMAGED, entry.path, size,
                              f"{_kind(mode)} stands where the writes of tag {tag or entry.name} "
                              "should be", KEEP_DIRTY)
            else:
                yield from self._write_dir(entry.path, entry.name, tag)

    def _write_dir(self, directory: str, dirname: str, tag: str | None) -> Iterator[Finding]:
        label = tag if tag is not None else dirname
        orphan = "" if tag is not None and tag in self._known.by_tag else (
            f"tag {label} has no registry entry")
        state_path = os.path.join(directory, WRITE_STATE)
        ancestors: tuple[str, ...] = ()
        if os.path.lexists(state_path):
            _, size = _lsize(state_path)
            doc, problem = self._read_json(state_path)
            if doc is not None:
                problem = _write_state_problem(doc)
                if not problem:
                    ancestors = tuple(doc.get("ancestors", ()))
            subject = f"write state of {label}"
            if problem:
                yield Finding(WRITE_STATES, DAMAGED, state_path, size, f"{subject}: {problem}",
                              KEEP_DIRTY)
            elif orphan:
                yield Finding(WRITE_STATES, ORPHANED, state_path, size, f"{subject}: {orphan}",
                              KEEP_DIRTY)
            else:
                yield Finding(WRITE_STATES, OK, state_path, size)
            for name, mark in ({} if problem or doc is None else
                               doc.get("damaged_blobs", {})).items():
                yield Finding(DIRTY, DAMAGED, state_path, 0,
                              f"dirty blob {name} of tag {label}: {mark['reason']}: it reads as "
                              "EIO until faultfs reset drops its writes", KEEP_DIRTY)

        def owns(header_tag: str) -> bool:
            if header_tag in ancestors:
                return True
            return header_tag == tag if tag is not None else (
                encode_component("t-", header_tag) == dirname)

        for entry in _scan(directory):
            if entry.name == WRITE_STATE:
                continue
            if _is_temp(entry.name):
                yield self._temp(entry.path)
            elif entry.name.startswith(("b-", "h-")):
                yield self._dirty_file(entry, label, owns, orphan)
            elif _direct_seq(entry.name) is not None:
                yield self._dirty_file(entry, label, owns, orphan, direct=True)
            else:
                yield self._unknown(entry.path)

    def _dirty_file(self, entry: os.DirEntry, label: str, owns: Callable[[str], bool],
                    orphan: str, *, direct: bool = False) -> Finding:
        """A dirty file, or (``direct``) a whole-chunk write's ``d-<seq>`` file that the
        next mount folds: the same format, naming that seq."""
        path = entry.path
        name, hashed = (None, True) if direct else self._blob_name(entry.name)
        if name is None and not hashed:
            return self._unknown(path)
        _, size = _lsize(path)
        blob = self._read_blob(path, owners=owns, name=name)
        header = blob.header
        problem = blob.problem
        if header is not None and not problem:
            if direct and header.source_version != f"{WAL_PREFIX}{_direct_seq(entry.name)}":
                problem = f"names another journal position ({header.source_version!r})"
            elif not direct and hashed and encode_component("b-", header.name) != entry.name:
                problem = f"holds blob {header.name!r}, which is not named so"
            elif not header.dirty:
                problem = "is not flagged dirty"
            elif not (header.source_version.startswith(WAL_PREFIX)
                      and header.source_version[len(WAL_PREFIX):].isdigit()):
                problem = f"names no journal position ({header.source_version!r})"
        shown = name or (header.name if header is not None else entry.name)
        subject = f"dirty blob {shown} of tag {label}"
        if problem:
            return Finding(DIRTY, DAMAGED, path, size, f"{subject}: {problem}", KEEP_DIRTY)
        if orphan:
            return Finding(DIRTY, ORPHANED, path, size, f"{subject}: {orphan}", KEEP_DIRTY)
        return Finding(DIRTY, OK, path, size)

    # -- the journal --------------------------------------------------------------------------

    def _journal(self, directory: str) -> Iterator[Finding]:
        """Segments in seq order, records verified as a replay reads them (``journal.py``):
        in order, seqs rising, up to the first record that does not verify."""
        segments: list[tuple[int, str]] = []
        for entry in _scan(directory):
            first = _segment_seq(entry.name)
            if first is None:
                yield self._unknown(entry.path)
            else:
                segments.append((first, entry.path))
        segments.sort()
        expect = 1
        stopped = ""
        for i, (first, path) in enumerate(segments):
            mode, size = _lsize(path)
            name = os.path.basename(path)
            if stopped:
                yield Finding(JOURNAL, DAMAGED, path, size,
                              f"journal segment {name}: follows {stopped}: not replayed (the "
                              f"next mount keeps it in writes/{DAMAGED_DIR}/ if its records "
                              "verify, else deletes it)", KEEP_JOURNAL)
                continue
            try:
                fd = open_regular(path)
            except ForeignEntry:
                yield Finding(JOURNAL, DAMAGED, path, size, f"{_kind(mode)} stands where journal "
                              f"segment {name} should be", KEEP_JOURNAL)
                stopped = f"journal segment {name}, which is not a file"
                continue
            if fd is None:
                continue
            try:
                expect = max(expect, first)
                scan = _SegmentScan(fd, os.fstat(fd).st_size, expect, last=i == len(segments) - 1)
                scan.run()
            finally:
                os.close(fd)
            expect = scan.expect
            if not scan.problem:
                yield Finding(JOURNAL, OK, path, size)
                continue
            after = f"after {scan.records} good records"
            if scan.torn:
                yield Finding(JOURNAL, DAMAGED, path, size,
                              f"journal segment {name}: torn tail at byte {scan.pos} {after} "
                              f"({scan.problem}; {size - scan.pos} bytes): the next mount cuts "
                              "it off", KEEP_JOURNAL)
            else:
                yield Finding(JOURNAL, DAMAGED, path, size,
                              f"journal segment {name}: the record at byte {scan.pos} {after} "
                              f"does not verify ({scan.problem}): the {size - scan.pos} bytes "
                              "from there are not replayed (the next mount keeps them in "
                              f"writes/{DAMAGED_DIR}/ if records that verify follow, else cuts "
                              "them off; a write's bad data is passed over instead when its "
                              "blob is one its tag's write state names damaged, or was reset "
                              "since)", KEEP_JOURNAL)
            stopped = f"a record that does not verify in {name}"

    # -- small entries ------------------------------------------------------------------------

    def _root_pass(self) -> Iterator[Finding]:
        for entry in _scan(self.root):
            if entry.name.startswith(PROBE_PREFIX):
                yield self._temp(entry.path)

    def _temp(self, path: str) -> Finding:
        _, size = _lsize(path)
        return Finding(TEMP, ORPHANED, path, size,
                       "temporary file of an interrupted write (never renamed into place)")

    def _unknown(self, path: str) -> Finding:
        mode, size = _lsize(path)
        what = "file" if stat_mod.S_ISREG(mode) else _kind(mode)
        return Finding(OTHER, ORPHANED, path, size, f"{what} faultfs does not know", KEEP_UNKNOWN)

    @staticmethod
    def _read_json(path: str) -> tuple[dict | None, str]:
        """A small JSON object file: ``(doc, "")`` or ``(None, what is wrong)``."""
        try:
            fd = open_regular(path)
        except ForeignEntry:
            mode, _ = _lsize(path)
            return None, f"{_kind(mode)}, not a file"
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


def _segment_seq(name: str) -> int | None:
    """The first seq a segment's name says (``w-<16 hex>.log``), else None."""
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX):-len(SEGMENT_SUFFIX)]
    if len(digits) != 16 or any(c not in "0123456789abcdef" for c in digits.lower()):
        return None
    return int(digits, 16)


class _SegmentScan:
    """Verify one segment's records as ``Journal.replay`` reads them, data hashed in pieces
    (a record may carry a whole blob): ``problem`` says why it stopped, at ``pos``; ``torn``
    when that is a partial last record of the last segment (a crash while appending)."""

    def __init__(self, fd: int, size: int, expect: int, *, last: bool) -> None:
        self.fd, self.size, self.expect, self.last = fd, size, expect, last
        self.pos = 0
        self.records = 0
        self.problem = ""
        self.torn = False

    def _stop(self, problem: str, *, torn: bool) -> None:
        self.problem = problem
        self.torn = self.last and torn

    def run(self) -> None:
        while self.pos < self.size:
            left = self.size - self.pos
            if left < HEAD_LEN:
                return self._stop(f"a partial record of {left} bytes", torn=True)
            raw = os.pread(self.fd, HEAD_LEN, self.pos)
            try:
                seq, kind, tag_len, name_len, _off, length, digest, check = decode_head(raw)
            except CorruptionError as exc:
                return self._stop(exc.message, torn=self._zeros_to_end())
            total = HEAD_LEN + tag_len + name_len + (length if kind == KIND_WRITE else 0)
            if total > left:
                return self._stop(f"a record of {total} bytes, {left} left", torn=True)
            names = os.pread(self.fd, tag_len + name_len, self.pos + HEAD_LEN)
            if xxhash.xxh3_64_intdigest(raw[:HEAD_LEN - 8] + names) != check:
                return self._stop("record header checksum mismatch", torn=total == left)
            try:
                names.decode("utf-8")
            except UnicodeDecodeError:
                return self._stop("record names are not UTF-8", torn=False)
            if seq < self.expect:
                return self._stop(f"seq {seq} after {self.expect - 1}", torn=False)
            if kind == KIND_WRITE and self._data_digest(self.pos + HEAD_LEN + len(names),
                                                        length) != digest:
                return self._stop("record data checksum mismatch", torn=total == left)
            self.expect = seq + 1
            self.records += 1
            self.pos += total
        return None

    def _data_digest(self, off: int, length: int) -> int:
        if not length:
            return 0
        digest = xxhash.xxh3_64()
        done = 0
        while done < length:
            piece = os.pread(self.fd, min(READ_STEP, length - done), off + done)
            if not piece:
                break
            digest.update(piece)
            done += len(piece)
        return digest.intdigest()

    def _zeros_to_end(self) -> bool:
        """Whether everything from ``pos`` on is zeros (space a crash left unwritten)."""
        off = self.pos
        while off < self.size:
            piece = os.pread(self.fd, min(READ_STEP, self.size - off), off)
            if not piece or piece.count(0) != len(piece):
                return False
            off += len(piece)
        return True


def _pagemap_problem(payload: bytes) -> str:
    """Why a stored pagemap shows no pages (``parse`` gives the empty map), or ""."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text: no pages are shown"
    if parse(text).empty:
        return "does not parse as a pagemap: no pages are shown"
    return ""


def _write_state_problem(doc: dict) -> str:
    for name, kind in WRITE_STATE_FIELDS.items():
        if name in doc and (not isinstance(doc[name], kind) or isinstance(doc[name], bool)):
            return f"field {name} is not {'an integer' if kind is int else kind.__name__}"
    for name in ("users", "voided_blobs"):
        table = doc.get(name, {})
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in table.values()):
            return f"field {name} maps names to something other than integers"
    if not all(isinstance(v, dict) and isinstance(v.get("reason"), str)
               and isinstance(v.get("size", 0), int) for v in doc.get("damaged_blobs", {}).values()):
        return "field damaged_blobs maps names to something other than reasons and sizes"
    if not all(isinstance(a, str) for a in doc.get("ancestors", ())):
        return "field ancestors names something other than tags"
    if not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0
               for u in doc.get("parted", ())):
        return "field parted lists something other than user blob ids"
    return ""


# -- fsck -------------------------------------------------------------------------------------

@dataclass
class Tally:
    """One row of the summary: entries checked and what they were."""

    checked: int = 0
    ok: int = 0
    damaged: int = 0
    stale: int = 0
    orphaned: int = 0
    bytes: int = 0

    def add(self, finding: Finding) -> None:
        self.checked += 1
        setattr(self, finding.status, getattr(self, finding.status) + 1)
        self.bytes += finding.size

    def to_doc(self) -> dict:
        return {"checked": self.checked, "ok": self.ok, "damaged": self.damaged,
                "stale": self.stale, "orphaned": self.orphaned, "bytes": self.bytes}


@dataclass
class FsckReport:
    root: str
    repair: bool
    rows: dict[str, Tally] = field(default_factory=lambda: {a: Tally() for a in AREAS})
    problems: int = 0
    dropped: int = 0
    dropped_bytes: int = 0
    kept: int = 0
    kept_why: dict[str, int] = field(default_factory=dict)  # keep reason -> problems kept

    @property
    def total(self) -> Tally:
        out = Tally()
        for row in self.rows.values():
            for name in ("checked", "ok", "damaged", "stale", "orphaned", "bytes"):
                setattr(out, name, getattr(out, name) + getattr(row, name))
        return out

    @property
    def clean(self) -> bool:
        return self.problems == 0


def fsck(root: str, *, repair: bool = False,
         on_finding: Callable[[Finding], None] | None = None) -> FsckReport:
    """Verify every file of the store at ``root`` (locked for the while; StoreBusy when a live
    mount owns it). ``repair``: drop damaged and stale clean data, orphaned clean blobs and
    temp files — never dirty data, write states or the journal (kept, reported).
    ``on_finding`` sees every finding as it is made, after the repair decided."""
    root = check_store_root(root)
    report = FsckReport(root, repair)
    with StoreLock(root):
        if repair:
            check_writable(root)
        walk = StoreWalk(root, verify=True)
        for finding in walk:
            report.rows[finding.area].add(finding)
            if finding.problem:
                report.problems += 1
                if finding.keep:
                    finding.action = "kept" if repair else ""
                    report.kept += 1
                    report.kept_why[finding.keep] = report.kept_why.get(finding.keep, 0) + 1
                elif repair:
                    report.dropped_bytes += walk.drop(finding)
                    report.dropped += 1
            if on_finding is not None:
                on_finding(finding)
    return report
