"""Large read buffers, recycled, that the kernel fills without faulting page by page.

The daemon fixes glibc's mmap threshold at 1 MiB (``fuse.serve.bound_malloc``) so freed blob
buffers leave the process and memory stays bounded. The price is that every large ``bytes``
is a fresh anonymous mapping, which the read filling it faults in 4 KiB at a time: a 1 MiB
``pread`` from the page cache then runs at about 1.6 GB/s on this machine, most of it page
faults, against 9 GB/s into a buffer that is already mapped (``docs/benchmarks.md``, "What
was tried").

So reads of ``SMALL`` (256 KiB) and more go into mappings of our own that are recycled: a buffer is
handed out as a ``memoryview``; the pool keeps the mapping and takes it back once no view of
it is alive (replies, blobs held in memory and store writes all hold views). "No view is
alive" is exactly when CPython lets an mmap be resized, so the pool asks that, for the same
size (a no-op ``mremap``), instead of counting references. Buffers of 2 MiB and more are also
advised huge pages (transparent huge pages are in ``madvise`` mode on most distributions).

Recycled buffers are not zeroed: ``alloc`` is for reads that fill what they return.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import threading
from typing import Any

SMALL = 256 << 10  # below this, the heap is cheaper than a mapping of our own
HUGE = 2 << 20  # a buffer this big may be backed by huge pages
KEEP_BYTES = 32 << 20  # free buffers kept mapped for reuse (counted in the daemon's RSS)
MAX_LENT = 4096  # buffers watched for return; the oldest are forgotten beyond this
RECLAIM_EVERY = 16  # with a free buffer at hand, look for returned ones every 16 allocations
# O_DIRECT reads and writes of these buffers (sources/local.py, store/direct.py): offsets,
# lengths and addresses in pages, which covers every device's block size
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def _map(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE and _MADV_HUGEPAGE is not None:
        try:
            buf.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass  # no huge pages here: small pages still work
    return buf


def _unused(buf: mmap.mmap) -> bool:
    """True when no memoryview of ``buf`` is alive (CPython refuses to resize it then)."""
    try:
        buf.resize(len(buf))
    except BufferError:
        return False
    return True


class BufferPool:
    """Mappings handed out as views and reused once every view is gone; at most
    ``keep_bytes`` of free ones stay mapped. Thread-safe (the I/O pool allocates too)."""

    def __init__(self, keep_bytes: int = KEEP_BYTES) -> None:
        self.keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._lent: collections.deque[mmap.mmap] = collections.deque()
        # id(buffer) -> buffer, least recently freed first
        self._free: collections.OrderedDict[int, mmap.mmap] = collections.OrderedDict()
        self._free_bytes = 0
        self.reused = 0
        self.mapped = 0
        self._allocs = 0

    def alloc(self, size: int) -> memoryview:
        """A writable buffer of ``size`` bytes with undefined contents."""
        if size < SMALL:
            return memoryview(bytearray(size))
        with self._lock:
            self._allocs += 1
            buf = self._take(size)
            if buf is None or self._allocs % RECLAIM_EVERY == 0:
                self._reclaim()  # one check per lent buffer: not on every allocation
                buf = buf or self._take(size)
        fresh = buf is None
        if buf is None:
            buf = _map(size)
        view = memoryview(buf)
        with self._lock:
            self.mapped += fresh
            self._lent.append(buf)
            while len(self._lent) > MAX_LENT:
                self._lent.popleft()  # forgotten: unmapped when its last view goes
        return view

    def _take(self, size: int) -> mmap.mmap | None:
        """The most recently freed buffer of ``size`` bytes, if any (under the lock)."""
        for key in reversed(self._free):
            buf = self._free[key]
            if len(buf) == size:
                del self._free[key]
                self._free_bytes -= size
                self.reused += 1
                return buf
        return None

    def _reclaim(self) -> None:
        """Move lent buffers that nothing uses any more to the free list, unmapping the
        least recently freed beyond ``keep_bytes`` — whatever their size, so a change of
        read size (source runs, then blobs) does not leave the list full of the old one."""
        still: collections.deque[mmap.mmap] = collections.deque()
        while self._lent:
            buf = self._lent.popleft()
            if _unused(buf):
                self._free[id(buf)] = buf
                self._free_bytes += len(buf)
            else:
                still.append(buf)
        self._lent = still
        while self._free_bytes > self.keep_bytes:
            _, old = self._free.popitem(last=False)
            self._free_bytes -= len(old)
            old.close()

    def clear(self) -> None:
        """Unmap every free buffer (lent ones go when their views do)."""
        with self._lock:
            for buf in self._free.values():
                buf.close()
            self._free.clear()
            self._free_bytes = 0

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def snapshot(self) -> dict[str, int]:
        """Counters for ``faultfs stat``: buffers mapped and reused, and what is held."""
        with self._lock:
            return {"mapped": self.mapped, "reused": self.reused, "lent": len(self._lent),
                    "free_bytes": self._free_bytes}


POOL = BufferPool()


class Pieces:
    """A destination of ``size`` bytes kept as one pooled buffer per ``piece`` bytes (the
    last shorter), each allocated when it is first sliced: a long source read received this
    way holds the pieces that landed and the one landing, never the whole read at once, and
    each piece is a buffer of its own (a blob dropped from memory frees just itself).

    Sliced like a memoryview: a slice inside one piece is a writable view of that piece; a
    slice across pieces is a ``Pieces`` window onto the same buffers. ``edge(pos)``: where
    the piece holding ``pos`` ends, for writers that fill up to it (``sources.s3.fill``)."""

    def __init__(self, size: int, piece: int) -> None:
        if piece <= 0 or size < 0:
            raise ValueError(f"bad pieces: {size} bytes in pieces of {piece}")
        self.piece = piece
        self._parts: list[memoryview | None] = [None] * -(-size // piece)
        self._end = size  # of the whole destination
        self._lo = 0  # this window's start in it ...
        self._size = size  # ... and length

    def __len__(self) -> int:
        return self._size

    def part(self, index: int) -> memoryview:
        """Piece ``index`` of the whole destination, allocated now if it is not yet."""
        got = self._parts[index]
        if got is None:
            size = min((index + 1) * self.piece, self._end) - index * self.piece
            got = self._parts[index] = alloc(size)
        return got

    def edge(self, pos: int) -> int:
        """Where (from this window's start) the piece holding byte ``pos`` ends."""
        return min(self._size, ((self._lo + pos) // self.piece + 1) * self.piece - self._lo)

    def __getitem__(self, key: slice) -> memoryview | Pieces:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Pieces are sliced by contiguous ranges only")
        start, stop, _ = key.indices(self._size)
        lo, hi = self._lo + start, self._lo + max(start, stop)
        if hi == lo:
            return memoryview(b"")
        first = lo // self.piece
        if (hi - 1) // self.piece == first:
            base = first * self.piece
            return self.part(first)[lo - base:hi - base]
        window = Pieces.__new__(Pieces)
        window.piece, window._parts, window._end = self.piece, self._parts, self._end
        window._lo, window._size = lo, hi - lo
        return window


def address_of(buf: Any) -> tuple[int, Any]:
    """The address of writable buffer ``buf``, and the object that keeps it exported (alive,
    unmoved, not resizable) until it is dropped."""
    anchor = ctypes.c_char.from_buffer(buf)
    return ctypes.addressof(anchor), anchor


def alloc(size: int) -> memoryview:
    """A writable buffer of ``size`` bytes with undefined contents, from the shared pool."""
    return POOL.alloc(size)


def pread_bytes(fd: int, size: int, off: int) -> bytes:
    """Up to ``size`` bytes of ``fd`` at ``off`` (short only at end of file), as one new
    ``bytes`` (the kernel's copy lands there: for readers that keep slices of it)."""
    out = os.pread(fd, size, off)
    if len(out) == size or not out:
        return out
    return out + bytes(pread_full(fd, size - len(out), off + len(out)))  # a rare short read


def pread_full(fd: int, size: int, off: int) -> memoryview:
    """Up to ``size`` bytes of ``fd`` at ``off``, read until the size or end of file
    (short only at end of file), into a buffer from the shared pool."""
    buf = alloc(size)
    got = 0
    while got < size:
        n = os.preadv(fd, [buf[got:]], off + got)
        if n == 0:
            break
        got += n
    return buf if got == size else buf[:got]
