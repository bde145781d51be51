"""The thin pyfuse3 adapter: each handler converts its arguments, awaits the namespace, and
builds the reply.

The only exception a handler raises is ``pyfuse3.FUSEError``: a ``FaultfsError`` becomes its
errno, anything unexpected is logged with its traceback and becomes EIO, so one bad request
never kills the daemon (``fuse_boundary``).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
from collections.abc import Callable
from typing import TYPE_CHECKING

from faultfs.core.names import XATTR_SOURCE, XATTR_STAGED, XATTR_TAG
from faultfs.core.ownership import Ownership
from faultfs.engine import Engine
from faultfs.errors import FaultfsError
from faultfs.fuse.handles import REOPEN_MASK, HandleTable
from faultfs.fuse.invalidate import Invalidator
from faultfs.fuse.lowlevel import native, pyfuse3
from faultfs.namespace import (
    BLOCK_SIZE,
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    Attributes,
    Files,
    OpenFile,
    PlainFile,
    Tree,
)

if TYPE_CHECKING:
    from faultfs.fuse.handover import SessionState

log = logging.getLogger("faultfs.fuse")
WRITEBACK_FH = 1 << 63  # _fastread.c: set in the fh of a WRITE of cached pages written back
PAGE_MASK = 4095
XATTR_OURS = b"user.faultfs."  # every attribute the tree has starts so (core.names)
assert all(n.encode().startswith(XATTR_OURS) for n in (XATTR_SOURCE, XATTR_STAGED, XATTR_TAG))
assert (pyfuse3.RENAME_NOREPLACE, pyfuse3.RENAME_EXCHANGE) == (RENAME_NOREPLACE, RENAME_EXCHANGE)


def fuse_boundary(fn):
    """Turn engine errors into their errno and anything unexpected into a logged EIO."""

    @functools.wraps(fn)
    async def wrapper(*args, **kwargs):
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FaultfsError as exc:
            log.debug("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def entry(attr: Attributes, owner: Ownership) -> pyfuse3.EntryAttributes:
    out = pyfuse3.EntryAttributes()
    out.st_ino = attr.inode
    out.st_mode = owner.mode(attr.mode)
    out.st_nlink = attr.nlink
    out.st_uid = owner.uid
    out.st_gid = owner.gid
    out.st_size = attr.size
    out.st_blocks = attr.blocks
    out.st_blksize = BLOCK_SIZE
    out.st_mtime_ns = attr.mtime_ns
    out.st_ctime_ns = attr.mtime_ns if attr.ctime_ns is None else attr.ctime_ns
    out.st_atime_ns = attr.mtime_ns if attr.atime_ns is None else attr.atime_ns
    out.entry_timeout = attr.entry_timeout
    out.attr_timeout = attr.attr_timeout
    return out


def file_info(fh: int, handle: OpenFile) -> pyfuse3.FileInfo:
    return pyfuse3.FileInfo(fh=fh, direct_io=handle.direct_io, keep_cache=handle.keep_cache)


class LostFile(PlainFile):
    """A handle the kernel held across a takeover that could not be opened again (its file
    was removed meanwhile): its number stays taken until the kernel releases it."""

    keep_cache = False
    direct_io = True

    def __init__(self, why: str) -> None:
        self.why = why

    async def read(self, off: int, size: int):
        raise FaultfsError(f"the file could not be opened again after a restart: {self.why}",
                           errno.EIO)

    async def write(self, off: int, data: bytes, *, cached: bool = False) -> int:
        return await self.read(off, len(data))


CRASH_AT = "FAULTFS_CRASH_AT"  # the crash sweep's seam (tests): "write:after", "open:before"…
CRASH_ARM = ".arm-crash"  # a lookup of this name arms it (so that the mount's own setup does not)
CRASHABLE = ("lookup", "getattr", "open", "read", "write", "fsync", "flush", "setattr",
             "create", "rename", "unlink", "release")


def arm_crash(ops: FaultOperations, spec: str) -> None:
    """Make the daemon kill itself (SIGKILL) in the first handler ``spec`` names after a lookup
    of ``CRASH_ARM``: ``before`` it does anything, or ``after`` it carried the request out and
    just before its reply is sent. The crash sweep of tests/test_mount_restart.py drives it;
    unset, nothing is wrapped."""
    name, _, when = spec.partition(":")
    if name not in CRASHABLE or when not in ("before", "after"):
        return
    original, lookup = getattr(ops, name), ops.lookup
    armed = [False]

    async def arming(parent_inode, name_, ctx=None):
        if name_ == CRASH_ARM.encode():
            armed[0] = True
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await (crashing if name == "lookup" else lookup)(parent_inode, name_, ctx)

    async def crashing(*args, **kwargs):
        if armed[0] and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = await original(*args, **kwargs)
        if armed[0]:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    log.warning("%s=%s: this daemon kills itself in its first %s after a lookup of %s",
                CRASH_AT, spec, name, CRASH_ARM)
    ops.lookup = arming  # type: ignore[method-assign]
    if name != "lookup":
        setattr(ops, name, crashing)


class FaultOperations(pyfuse3.Operations):
    """pyfuse3 operations over a ``Tree`` of an ``Engine``.

    With a session state (a holder keeps the mount, fuse/handover.py) every open handle is
    kept there, and a request that changes the tree is remembered with its result just before
    it is answered: when the kernel resends one the dead daemon carried out (its unique marked
    resent), it is answered from there, not done twice."""

    def __init__(self, engine: Engine, ownership: Ownership | None = None,
                 session: SessionState | None = None) -> None:
        super().__init__()
        self.engine = engine
        # every entry's owner and bits (--uid, --gid, --file-mode, --dir-mode, --umask);
        # default: the daemon's user, the tree's bits
        self.ownership = ownership or Ownership(os.getuid(), os.getgid())
        self.tree = Tree(engine)
        self.files = Files(self.tree)
        self.handles = HandleTable(session)
        self.session = session
        # the unique of the request being handled: read first thing in a handler, before
        # any await (pyfuse3 runs a handler up to its first await right after receiving it)
        self._unique = native.current_unique if session is not None and native else None
        self.tree.daemon_info = self.daemon_info
        if session is not None:  # entries' times must not change under the kernel's caches
            self.tree.mounted_at = int(session.describe()["mount_started"] * 1e9)

        self.invalidator = Invalidator()
        self.files.coherence.drop = self.invalidator.drop
        self.files.invalidate_entry = self.invalidator.entry
        engine.pages.subscribe(self.invalidator.pages_changed)
        # the fast read path (fastread.py), while serve runs it: told of chunk and view opens
        self.file_opened: Callable[[OpenFile], None] | None = None
        # whether it marks the WRITEs that write back cached pages (WRITEBACK_FH); without it
        # a write of whole pages is taken for one
        self.writebacks_marked = False

    @fuse_boundary
    async def lookup(self, parent_inode, name, ctx=None):
        return entry(await self.tree.lookup(parent_inode, os.fsdecode(name)), self.ownership)

    @fuse_boundary
    async def getattr(self, inode, ctx=None):
        return entry(await self.tree.getattr(inode), self.ownership)

    async def forget(self, inode_list):
        return  # computed inodes: nothing was allocated, nothing to release

    @fuse_boundary
    async def opendir(self, inode, ctx):
        if not self.tree.node(inode).is_dir:
            raise FaultfsError("not a directory", errno.ENOTDIR)
        return inode

    @fuse_boundary
    async def readdir(self, fh, start_id, token):
        for pos, name, attr in await self.tree.listing(fh, start_id):
            if not pyfuse3.readdir_reply(token, os.fsencode(name), entry(attr, self.ownership),
                                         pos + 1):
                break

    async def releasedir(self, fh):
        return

    # -- the session across daemons (fuse/handover.py) ------------------------------------------

    def daemon_info(self) -> dict:
        """Who serves the mount: ``faultfs stat``'s daemon line."""
        info = {"pid": os.getpid(), "started": self.engine.stats.started, "holder": False,
                "takeovers": 0}
        if self.session is not None:
            info.update(self.session.describe(), holder=True)
            info["started"] = info.pop("daemon_started") or info["started"]
        return info

    def serving(self) -> None:
        """The mount answers (and the holder keeps it): the crash sweep's seam may arm."""
        if self.session is not None and not self.session.takeovers:  # its replacement lives
            arm_crash(self, os.environ.get(CRASH_AT, ""))

    def unique(self) -> int:
        return self._unique() if self._unique is not None else 0

    def done_before(self, unique: int) -> int | None:
        """The result of a resent request the dead daemon carried out, else None."""
        return None if self.session is None else self.session.answer(unique)

    def answering(self, unique: int, result: int = 0) -> None:
        if self.session is not None and unique:
            self.session.answered(unique, result)

    async def restore(self) -> int:
        """Open again every handle the kernel held when the mount was taken over."""
        if self.session is None:
            return 0
        for fh, inode, flags in self.session.handles():
            try:
                handle = await self.files.open(inode, flags & REOPEN_MASK)
            except FaultfsError as exc:
                log.warning("file handle %d (inode %d) cannot be opened again: %s", fh, inode,
                            exc)
                handle = LostFile(str(exc))
            else:
                if self.file_opened is not None:
                    self.file_opened(handle)
            self.handles.put(fh, handle)
        self.handles.restored()
        return len(self.handles)

    # -- files ----------------------------------------------------------------------------------

    @fuse_boundary
    async def open(self, inode, flags, ctx):
        unique = self.unique()
        done = self.done_before(unique)
        kept = self.handles.get(done) if done is not None else None
        if kept is not None:  # opened by the dead daemon (and opened again): that handle
            return file_info(done, kept)
        handle = await self.files.open(inode, flags)
        if self.file_opened is not None:
            self.file_opened(handle)
        fh = self.handles.add(handle, inode, flags)
        self.answering(unique, fh)
        return file_info(fh, handle)

    @fuse_boundary
    async def create(self, parent_inode, name, mode, flags, ctx):
        unique = self.unique()
        inode = self.done_before(unique)
        if inode is not None:  # created by the dead daemon: open what it made
            handle = await self.files.open(inode, flags & REOPEN_MASK)
            attr = await self.tree.getattr(inode)
        else:
            handle, attr = await self.files.create(parent_inode, os.fsdecode(name), flags,
                                                   mode & 0o7777)
        fi = file_info(self.handles.add(handle, attr.inode, flags), handle)
        self.answering(unique, attr.inode)
        return fi, entry(attr, self.ownership)

    @fuse_boundary
    async def read(self, fh, off, size):
        return await self.handles[fh].read(off, size)

    async def write(self, fh, off, buf):
        unique = self.unique()
        if unique >> 63:  # resent: answered from the session when it was done already
            done = self.done_before(unique)
            if done is not None:
                return done
        try:  # fuse_boundary inline: a write is the hottest request, one frame less
            if fh & WRITEBACK_FH:  # cached pages written back (marked by the fast read path)
                n = await self.handles[fh ^ WRITEBACK_FH].write(off, buf, cached=True)
            elif not self.writebacks_marked and not (off | len(buf)) & PAGE_MASK:
                n = await self.handles[fh].write(off, buf, cached=True)  # (as good a guess)
            else:
                n = await self.handles[fh].write(off, buf)
            if unique:
                self.answering(unique, n)
            return n
        except FaultfsError as exc:
            log.debug("write: %s", exc)
            raise pyfuse3.FUSEError(exc.errno) from None
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("unexpected error in write")
            raise pyfuse3.FUSEError(errno.EIO) from None

    @fuse_boundary
    async def setattr(self, inode, attr, fields, fh, ctx):
        unique = self.unique()
        if fields.update_size and self.done_before(unique) is None:
            await self.files.set_size(inode, attr.st_size, self.handles.get(fh))
            self.answering(unique)
        if ((fields.update_uid and attr.st_uid != self.ownership.uid)
                or (fields.update_gid and attr.st_gid != self.ownership.gid)):
            raise FaultfsError("every entry belongs to the mount's owner", errno.EPERM)
        if fields.update_mode or fields.update_atime or fields.update_mtime:
            await self.files.set_attrs(
                inode, mode=attr.st_mode & 0o7777 if fields.update_mode else None,
                atime_ns=attr.st_atime_ns if fields.update_atime else None,
                mtime_ns=attr.st_mtime_ns if fields.update_mtime else None)
        return entry(await self.tree.getattr(inode), self.ownership)

    @fuse_boundary
    async def fsync(self, fh, datasync):
        await self.handles[fh].fsync()

    @fuse_boundary
    async def flush(self, fh):
        await self.handles[fh].flush()

    @fuse_boundary
    async def release(self, fh):
        unique = self.unique()
        if self.done_before(unique) is not None:
            return  # released by the dead daemon: fh may be a new open's number by now
        self.answering(unique)  # first: a kill in between leaves a handle kept, never one
        handle = self.handles.pop(fh)  # released twice (a new open may have its number)
        if handle is not None:
            await handle.release()

    @fuse_boundary
    async def unlink(self, parent_inode, name, ctx):
        unique = self.unique()
        if self.done_before(unique) is None:
            await self.files.remove(parent_inode, os.fsdecode(name))
            self.answering(unique)

    @fuse_boundary
    async def rmdir(self, parent_inode, name, ctx):
        await self.files.remove_dir(parent_inode, os.fsdecode(name))

    @fuse_boundary
    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        unique = self.unique()
        if self.done_before(unique) is None:
            await self.files.rename(parent_inode_old, os.fsdecode(name_old), parent_inode_new,
                                    os.fsdecode(name_new), flags)
            self.answering(unique)

    @fuse_boundary
    async def mkdir(self, parent_inode, name, mode, ctx):
        await self.files.change(parent_inode, os.fsdecode(name))

    @fuse_boundary
    async def mknod(self, parent_inode, name, mode, rdev, ctx):
        await self.files.change(parent_inode, os.fsdecode(name))

    @fuse_boundary
    async def symlink(self, parent_inode, name, target, ctx):
        await self.files.change(parent_inode, os.fsdecode(name))

    @fuse_boundary
    async def link(self, inode, new_parent_inode, new_name, ctx):
        await self.files.change(new_parent_inode, os.fsdecode(new_name))

    async def getxattr(self, inode, name, ctx):
        # The kernel asks for "security.capability" before every write (file_remove_privs;
        # pyfuse3 cannot negotiate FUSE_HANDLE_KILLPRIV_V2). Without --xattrs the first ask is
        # answered ENOSYS and the kernel never asks again: one request per write, not two.
        # With them, names outside ours are answered at once, with no engine work.
        if not self.engine.config.xattrs:
            self.engine.stats.add("xattrs_refused")  # once: the kernel stops asking
            raise pyfuse3.FUSEError(errno.ENOSYS)
        if not name.startswith(XATTR_OURS):
            raise pyfuse3.FUSEError(errno.ENODATA)
        return await self._getxattr(inode, name)

    @fuse_boundary
    async def _getxattr(self, inode, name):
        value = self.tree.xattrs(await self.tree.load(inode)).get(os.fsdecode(name))
        if value is None:
            raise FaultfsError("no such attribute", errno.ENODATA)
        return value

    @fuse_boundary
    async def listxattr(self, inode, ctx):
        if not self.engine.config.xattrs:
            raise FaultfsError("extended attributes are off (mount with --xattrs)", errno.ENOSYS)
        return [os.fsencode(name) for name in self.tree.xattrs(await self.tree.load(inode))]

    @fuse_boundary
    async def statfs(self, ctx):
        st = await self.engine.pool.run(os.statvfs, self.engine.store.root)
        out = pyfuse3.StatvfsData()
        for name in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                     "f_ffree", "f_favail"):
            setattr(out, name, getattr(st, name))
        out.f_namemax = 255
        return out

