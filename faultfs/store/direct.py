"""Writing a new clean blob around the page cache (``O_DIRECT``).

A faulted blob is written once and then read from the reader's own page cache (the FUSE
file's) or from memory; a second copy in the store file's page cache costs the ``pwrite``'s
copy of every byte (about a third of the daemon's CPU on a cold S3 read, with the socket's
receive and the FUSE reply), the kernel's writeback of it later, and memory the reader's
cache could use. So a blob whose payload is a page-aligned buffer of whole pages (the pooled
buffers every fault of ``buffers.SMALL`` and more reads into) is written with one ``pwritev``
of its header (copied into an aligned page) and its payload, straight from the buffer to the
device.

Anything else takes the page cache as before, and so does every write on a file system that
refuses ``O_DIRECT`` (tmpfs on older kernels, some FUSE and network file systems: ``fcntl``
answers ``EINVAL``; the store then stops trying). Nothing here changes the blob format or
what a crash leaves: the blob is not synced either way, and a torn one fails verification.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading

from faultfs.buffers import ALIGN, O_DIRECT, address_of
from faultfs.store.durable import write_parts

_pages = threading.local()  # one aligned header page per I/O thread


def aligned(view: memoryview) -> bool:
    """True when ``view`` can be written with ``O_DIRECT``: writable (its address can be
    read), page-aligned, and whole pages long."""
    if not O_DIRECT or view.readonly or not view.contiguous or view.nbytes % ALIGN:
        return False
    address, _ = address_of(view)  # the export it holds ends with this call
    return address % ALIGN == 0


def _header_page(header: bytes) -> memoryview:
    page = getattr(_pages, "page", None)
    if page is None:
        page = _pages.page = mmap.mmap(-1, ALIGN)
    view = memoryview(page)
    view[:len(header)] = header
    return view[:len(header)]


def write_blob(fd: int, header: bytes, payload: memoryview) -> bool:
    """Write ``header`` then ``payload`` at offset 0 of the new, empty file ``fd``, around
    the page cache. False (nothing written, ``fd`` as it was) when the file system refuses
    ``O_DIRECT``; the caller then writes through the page cache and need not try again.
    ``header`` is a whole number of pages, ``payload`` passed ``aligned``."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    total = len(header) + payload.nbytes
    try:
        written = os.pwritev(fd, [_header_page(header), payload], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        written = 0  # a device with larger blocks than a page: the page cache takes it
    if written < total:  # short (a full device mid-write, a signal) or refused: buffered
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        parts = [header, payload]
        if written >= len(header):
            parts = [payload[written - len(header):]]
        elif written:
            parts = [header[written:], payload]
        write_parts(fd, parts, at=written)
    return True
