"""fuse_ceiling: the fastest a pyfuse3 + trio file system can serve reads on this machine.

One read-only file ``MNT/big.bin`` of ``--size`` bytes whose reads return slices of a constant
buffer (memoryviews: no copy in Python). No store, no threads, no checksums: what is left is the
kernel <-> pyfuse3 <-> trio round trip per request, which is the ceiling faultfs is measured
against by ``scripts/bench``. Mount options and ``keep_cache`` mirror faultfs's read-only views.
With ``--writable`` the file also takes writes, acknowledges them and drops the bytes (fsync,
flush: nothing to do): the ceiling of the write cases. Reads still return the constant buffer.

    .venv/bin/python scripts/fuse_ceiling.py MNT --size 1073741824 [--writable] [--ready-file F] [--stats-file F]

Runs in the foreground until unmounted (``fusermount3 -u MNT``) or SIGTERM/SIGINT. With
``--stats-file``, writes ``{"reads": N, "bytes": B, "writes": N, "wbytes": B}`` there on SIGUSR1
and at exit (how many read and write requests the kernel sent, and so their average size).
"""

import argparse
import errno
import json
import os
import signal
import stat
import sys

import pyfuse3
import trio

NAME = b"big.bin"
FILE_INODE = pyfuse3.ROOT_INODE + 1
BUFFER_BYTES = 32 << 20  # larger than any FUSE request, so every read is one slice


class CeilingOperations(pyfuse3.Operations):
    def __init__(self, size: int, writable: bool = False) -> None:
        super().__init__()
        self.size = size
        self.writable = writable
        self.writes = 0
        self.wbytes = 0
        pattern = bytes(range(256)) * (BUFFER_BYTES // 256)
        self.buffer = memoryview(pattern)
        self.reads = 0
        self.bytes = 0

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.st_uid = os.getuid()
        attr.st_gid = os.getgid()
        attr.st_nlink = 1 if inode == FILE_INODE else 2
        if inode == FILE_INODE:
            attr.st_mode = stat.S_IFREG | (0o644 if self.writable else 0o444)
            attr.st_size = self.size
        else:
            attr.st_mode = stat.S_IFDIR | 0o755
        attr.st_blksize = 1 << 17
        attr.st_blocks = (attr.st_size + 511) // 512
        attr.attr_timeout = 300
        attr.entry_timeout = 300
        return attr

    async def getattr(self, inode, ctx=None):
        if inode not in (pyfuse3.ROOT_INODE, FILE_INODE):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode != pyfuse3.ROOT_INODE or name != NAME:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(FILE_INODE)

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        if start_id == 0:
            pyfuse3.readdir_reply(token, NAME, self._attr(FILE_INODE), 1)

    async def open(self, inode, flags, ctx):
        if inode != FILE_INODE:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & os.O_ACCMODE != os.O_RDONLY and not self.writable:
            raise pyfuse3.FUSEError(errno.EROFS)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def write(self, fh, off, buf):
        if off + len(buf) > self.size:
            raise pyfuse3.FUSEError(errno.EFBIG)  # the file has a fixed size
        self.writes += 1
        self.wbytes += len(buf)
        return len(buf)

    async def fsync(self, fh, datasync):
        pass

    async def flush(self, fh):
        pass

    async def read(self, fh, off, size):
        self.reads += 1
        end = min(off + size, self.size)
        if end <= off:
            return b""
        start = off % BUFFER_BYTES
        if start + (end - off) > BUFFER_BYTES:
            start = 0
        self.bytes += end - off
        return self.buffer[start:start + end - off]

    async def release(self, fh):
        pass

    async def releasedir(self, fh):
        pass

    async def statfs(self, ctx):
        st = pyfuse3.StatvfsData()
        st.f_bsize = 4096
        st.f_frsize = 4096
        st.f_blocks = self.size // 4096
        st.f_namemax = 255
        return st


def write_stats(ops: CeilingOperations, path: str | None) -> None:
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump({"reads": ops.reads, "bytes": ops.bytes, "writes": ops.writes,
                       "wbytes": ops.wbytes}, f)
        os.replace(path + ".tmp", path)


async def _handle_signals(ops: CeilingOperations, stats_file: str | None) -> None:
    """SIGUSR1: write the request counts now; SIGTERM/SIGINT: unmount and exit."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
        async for signum in signals:
            if signum == signal.SIGUSR1:
                write_stats(ops, stats_file)
                continue
            pyfuse3.terminate()
            return


async def _serve(ops: CeilingOperations, ready_file: str | None, stats_file: str | None) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_handle_signals, ops, stats_file)
        if ready_file:
            with open(ready_file, "w") as f:  # noqa: ASYNC230 (once, before serving)
                f.write(str(os.getpid()))
        await pyfuse3.main()  # returns on terminate() or when unmounted from outside
        nursery.cancel_scope.cancel()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mountpoint")
    parser.add_argument("--size", type=int, default=1 << 30)
    parser.add_argument("--writable", action="store_true",
                        help="take writes (acknowledged and dropped)")
    parser.add_argument("--ready-file", help="written with our pid once the mount is up")
    parser.add_argument("--stats-file", help="written with the request counts at exit")
    args = parser.parse_args()
    ops = CeilingOperations(args.size, args.writable)
    options = set(pyfuse3.default_options)  # the same base options faultfs mounts with
    options.add("fsname=fuse_ceiling")
    options.add("subtype=fuse_ceiling")
    pyfuse3.init(ops, args.mountpoint, options)
    try:
        trio.run(_serve, ops, args.ready_file, args.stats_file)
    finally:
        pyfuse3.close(unmount=True)
        write_stats(ops, args.stats_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
