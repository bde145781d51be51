"""Pagify: assemble a page from its blob slices (and scatter a page back) over injected blob I/O.

Invariants (DESIGN §6, upstream ``pagify.h``):

- A request addresses a *window* ``[offset, offset+len)`` of one page, clipped to the page size;
  the whole page is the window ``offset=0, len=page_size``. Every page is ``page_size`` bytes,
  including pages past the map's end.
- The destination is zeroed before any slice lands, so gaps and bytes past ``total`` read as
  zero. A window with no slices is ``ok`` and all zeros.
- A slice read that moves a count other than its size fails the page (``ok=False``); a failed
  page's bytes must never be served. Exceptions of the callables propagate unchanged.
- Writes touch mapped slices only; bytes of the source that fall in gaps are skipped.
- The empty map (no usable pagemap) fails every request with ``ok=False``.
- No I/O here: the callables do it. ``read_page``/``write_page`` run slices one after another;
  an engine that fetches slices concurrently uses ``plan_page`` and then ``assemble`` (it has
  the bytes) or ``tally`` (it read into place), and gets the same result from one place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from faultfs.core.pagemap import PageMap, PageSlice
from faultfs.errors import InvalidInput

# read_fn(blob_name, blob_off, size, view) -> bytes read into view (len(view) == size).
ReadFn = Callable[[str, int, int, memoryview], int]
# write_fn(blob_name, blob_off, data) -> bytes written of data.
WriteFn = Callable[[str, int, memoryview], int]
Bytes = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class PageIoResult:
    """What one page request did: for stats and for the ok/EIO decision."""

    ok: bool
    slices: int  # slices composing the window
    bytes: int  # bytes moved between blobs and the page before any failure
    zero_filled: int  # window bytes covered by no slice: zeros on read, skipped on write


def window_size(pagemap: PageMap, offset: int, size: int | None = None) -> int:
    """Length of the window ``[offset, offset+size)`` of a page once clipped to the page size."""
    if offset < 0 or (size is not None and size < 0):
        raise InvalidInput(f"page window offset {offset} size {size} is negative")
    end = pagemap.page_size if size is None else min(offset + size, pagemap.page_size)
    return max(0, end - offset)


def plan_page(
    pagemap: PageMap, page_id: int, offset: int = 0, size: int | None = None
) -> list[PageSlice]:
    """The slices filling window ``[offset, offset+size)`` of page ``page_id`` (``size`` None:
    to the page end), clipped to the window, with ``dst_off`` relative to ``offset``.
    """
    length = window_size(pagemap, offset, size)
    if length == 0:
        return []
    end = offset + length
    planned: list[PageSlice] = []
    for s in pagemap.to_page(page_id):
        lo = max(s.dst_off, offset)
        hi = min(s.dst_off + s.size, end)
        if lo < hi:
            planned.append(
                PageSlice(s.blob_name, s.blob_off + lo - s.dst_off, lo - offset, hi - lo)
            )
    return planned


def tally(slices: Sequence[PageSlice], counts: Sequence[int], window: int) -> PageIoResult:
    """The result of a window whose slices moved ``counts[i]`` bytes each (missing: not run)."""
    covered = sum(s.size for s in slices)
    moved = 0
    ok = len(counts) == len(slices)
    for s, n in zip(slices, counts, strict=False):  # counts stop at the first failure
        if n != s.size:
            ok = False  # a short (or impossible long) transfer fails the whole page
        moved += max(0, min(n, s.size))
    return PageIoResult(ok, len(slices), moved, window - covered)


def _zero(view: memoryview) -> None:
    view[:] = bytes(len(view))


def assemble(
    dst: bytearray | memoryview, slices: Sequence[PageSlice], pieces: Sequence[Bytes | None]
) -> PageIoResult:
    """Zero ``dst`` (the window) and copy ``pieces[i]`` (the bytes of ``slices[i]``, None when
    it could not be fetched) into place. A piece of the wrong length fails the page.
    """
    if len(pieces) != len(slices):
        raise InvalidInput(f"assemble: {len(pieces)} pieces for {len(slices)} slices")
    view = memoryview(dst).cast("B")
    _zero(view)
    counts: list[int] = []
    for s, piece in zip(slices, pieces, strict=True):
        if piece is None:
            counts.append(0)
            continue
        data = memoryview(piece).cast("B")
        n = min(len(data), s.size)
        view[s.dst_off : s.dst_off + n] = data[:n]
        counts.append(len(data))
    return tally(slices, counts, len(view))


def read_page(
    pagemap: PageMap, page_id: int, dst: bytearray | memoryview, read_fn: ReadFn, offset: int = 0
) -> PageIoResult:
    """Fill ``dst`` with bytes ``[offset, offset+len(dst))`` of page ``page_id``.

    ``dst`` is zeroed first (also any part of it past the page end), then every slice is read
    into place with ``read_fn``; the first short read stops and fails the page.
    """
    view = memoryview(dst).cast("B")
    _zero(view)
    if pagemap.empty:
        return PageIoResult(False, 0, 0, 0)
    window = window_size(pagemap, offset, len(view))
    slices = plan_page(pagemap, page_id, offset, window)
    counts: list[int] = []
    for s in slices:
        n = read_fn(s.blob_name, s.blob_off, s.size, view[s.dst_off : s.dst_off + s.size])
        counts.append(n)
        if n != s.size:
            break
    return tally(slices, counts, window)


def write_page(
    pagemap: PageMap, page_id: int, src: Bytes, write_fn: WriteFn, offset: int = 0
) -> PageIoResult:
    """Write ``src`` as bytes ``[offset, offset+len(src))`` of page ``page_id`` into its blobs.

    Only mapped slices are written; bytes over gaps or past the page end are skipped. The first
    short write stops and fails the page.
    """
    if pagemap.empty:
        return PageIoResult(False, 0, 0, 0)
    view = memoryview(src).cast("B")
    window = window_size(pagemap, offset, len(view))
    slices = plan_page(pagemap, page_id, offset, window)
    counts: list[int] = []
    for s in slices:
        n = write_fn(s.blob_name, s.blob_off, view[s.dst_off : s.dst_off + s.size])
        counts.append(n)
        if n != s.size:
            break
    return tally(slices, counts, window)
