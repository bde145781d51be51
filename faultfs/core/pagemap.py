"""PageMap: pure arithmetic laying numbered pages of a global page space onto named blob bytes.

Invariants (DESIGN §6, upstream ``page_map.h`` plus the hostile-input limits of
``docs/FORMAT-pagemap.md``):

- A map is made by ``build``, ``parse``/``parse_strict`` or ``identity``. Its extents are sorted
  by ``page_off``, have ``size > 0`` and never overlap in page space (first writer wins: an
  extent starting before the end of the previous kept one is dropped whole, never trimmed).
- Gaps between extents are legal and read as zero; ``total`` is the end of the last extent.
- The *empty* map (``page_size == 0``) means "no usable pagemap": it has no pages and is what
  ``parse`` returns for malformed or hostile text. ``build`` turns page size 0 into 1.
- Every number is ``0 <= n < 2**63``, page sizes are at most 1 GiB, blob names are non-empty,
  contain no ``/``, NUL or whitespace, and no input makes parsing allocate or loop without bound.
- ``parse(m.serialize()) == m`` for every map.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

from faultfs.core.names import PAGE_PREFIX
from faultfs.errors import InvalidInput

# Upstream stores offsets as uint64; refusing >= 2**63 keeps every sum of two values inside
# uint64 so a map we accept is one the C++ engine reads identically.
MAX_PAGEMAP_VALUE = 2**63 - 1
# A page is one read buffer; a hostile map must not make a reader allocate more than this.
MAX_PAGE_SIZE = 1 << 30
# An identity map of a 1 TiB range in 1 MiB chunks; a parsed extent costs a few hundred bytes
# of Python objects, so this bounds a parsed map to a few hundred MiB.
MAX_PAGEMAP_EXTENTS = 1 << 20
# Extent lines plus the header and generous blank-line slack; counted in C before any split,
# so a text of a million empty lines is refused before a line list is built.
MAX_PAGEMAP_LINES = MAX_PAGEMAP_EXTENTS + 4096
# MAX_PAGEMAP_EXTENTS lines of about 64 characters; longer texts are refused before parsing.
MAX_PAGEMAP_TEXT = 64 << 20
# A page read assembles every slice of its window; a page may have at most this many slices,
# so one read of one page bounds the work (and the blobs fetched) one request can cause.
MAX_PAGE_SLICES = 1 << 16
# from_page materialises one PageRef per page touched; more than this must use iter_from_page.
MAX_PAGE_REFS = 1 << 20
# DESIGN §7: a blob name over 255 bytes cannot be a file name in the mount.
MAX_BLOB_NAME_BYTES = 255
# A slice naming a page blob would send a page read back through the page path without end.
PAGE_BLOB_PREFIX = PAGE_PREFIX

_HEADER = "pagemap"
_PAGE_SIZE_KEY = "page_size="
_TOTAL_KEY = "total="


@dataclass(frozen=True, slots=True)
class PageExtent:
    """Bytes ``[blob_off, blob_off+size)`` of blob ``blob_name`` land at ``page_off`` of page space."""

    blob_name: str
    blob_off: int
    page_off: int
    size: int


@dataclass(frozen=True, slots=True)
class PageSlice:
    """One piece of a page: ``size`` bytes of ``blob_name`` at ``blob_off`` go to ``dst_off``."""

    blob_name: str
    blob_off: int
    dst_off: int
    size: int


@dataclass(frozen=True, slots=True)
class PageRef:
    """One piece of a blob byte range: it lives in page ``page_id`` at ``dst_off``."""

    page_id: int
    dst_off: int
    blob_off: int
    size: int


def _extent_end(extent: PageExtent) -> int:
    return extent.page_off + extent.size


@dataclass(frozen=True, slots=True)
class PageMap:
    """A page size and the kept extents; build it with ``build``, ``parse`` or ``identity``."""

    page_size: int
    extents: tuple[PageExtent, ...]
    # Lazily built index blob name -> positions in ``extents``, for from_page.
    _by_blob: dict[str, tuple[int, ...]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.page_size == 0 and self.extents:
            raise InvalidInput("pagemap: the empty map (page_size 0) has no extents")
        end = 0
        for extent in self.extents:
            if extent.size <= 0 or extent.page_off < end:
                raise InvalidInput("pagemap: extents must be sorted, non-empty and disjoint")
            end = extent.page_off + extent.size

    @property
    def empty(self) -> bool:
        """True for the map that means "no usable pagemap" (page size 0)."""
        return self.page_size == 0

    @property
    def total(self) -> int:
        """Bytes of page space covered: the end of the last extent (gaps included)."""
        return _extent_end(self.extents[-1]) if self.extents else 0

    @property
    def num_pages(self) -> int:
        if self.page_size == 0:
            return 0
        return -(-self.total // self.page_size)

    def to_page(self, page_id: int) -> list[PageSlice]:
        """The slices composing page ``page_id``, in page order; ``[]`` past the end or for gaps."""
        ps = self.page_size
        if ps == 0 or page_id < 0:
            return []
        lo = page_id * ps
        hi = lo + ps
        if lo >= self.total:
            return []
        extents = self.extents
        # Kept extents are disjoint and sorted, so their ends are sorted too.
        i = bisect_right(extents, lo, key=_extent_end)
        slices: list[PageSlice] = []
        while i < len(extents) and extents[i].page_off < hi:
            e = extents[i]
            s = max(lo, e.page_off)
            t = min(hi, e.page_off + e.size)
            slices.append(PageSlice(e.blob_name, e.blob_off + s - e.page_off, s - lo, t - s))
            i += 1
        return slices

    def iter_from_page(self, blob_name: str, blob_off: int, size: int) -> Iterator[PageRef]:
        """Lazily, the pages holding bytes ``[blob_off, blob_off+size)`` of one blob."""
        ps = self.page_size
        for e, s, t in self._overlaps(blob_name, blob_off, size):
            while s < t:
                p = e.page_off + (s - e.blob_off)
                page_id, dst_off = divmod(p, ps)
                n = min(t - s, ps - dst_off)
                yield PageRef(page_id, dst_off, s, n)
                s += n

    def from_page(self, blob_name: str, blob_off: int, size: int) -> list[PageRef]:
        """The pages holding bytes ``[blob_off, blob_off+size)`` of one blob, in page order.

        Raises InvalidInput when that would be more than MAX_PAGE_REFS pieces (tiny pages under
        a large range); such callers iterate ``iter_from_page`` instead.
        """
        if self._count_refs(blob_name, blob_off, size) > MAX_PAGE_REFS:
            raise InvalidInput(
                f"pagemap: range of {blob_name!r} spans more than {MAX_PAGE_REFS} pages"
            )
        return list(self.iter_from_page(blob_name, blob_off, size))

    def serialize(self) -> str:
        """The text form (docs/FORMAT-pagemap.md); ``parse`` reads it back to an equal map."""
        head = f"{_HEADER}\n{_PAGE_SIZE_KEY}{self.page_size}\n{_TOTAL_KEY}{self.total}\n"
        return head + "".join(
            f"{e.blob_name} {e.blob_off} {e.page_off} {e.size}\n" for e in self.extents
        )

    def _overlaps(self, blob_name: str, blob_off: int, size: int
                  ) -> Iterator[tuple[PageExtent, int, int]]:
        """Each extent of ``blob_name`` overlapping ``[blob_off, blob_off+size)``, with the
        overlap ``[s, t)`` in blob offsets (nothing when the map has no pages)."""
        if self.page_size == 0 or size <= 0 or blob_off < 0:
            return
        lo, hi = blob_off, blob_off + size
        for i in self._blob_index().get(blob_name, ()):
            e = self.extents[i]
            s = max(lo, e.blob_off)
            t = min(hi, e.blob_off + e.size)
            if s < t:
                yield e, s, t

    def _count_refs(self, blob_name: str, blob_off: int, size: int) -> int:
        ps = self.page_size
        count = 0
        for e, s, t in self._overlaps(blob_name, blob_off, size):
            first = e.page_off + (s - e.blob_off)
            last = first + (t - s) - 1
            count += last // ps - first // ps + 1
        return count

    def _blob_index(self) -> dict[str, tuple[int, ...]]:
        if self._by_blob is None:
            index: dict[str, list[int]] = {}
            for i, e in enumerate(self.extents):
                index.setdefault(e.blob_name, []).append(i)
            object.__setattr__(self, "_by_blob", {k: tuple(v) for k, v in index.items()})
        assert self._by_blob is not None
        return self._by_blob


EMPTY_PAGEMAP = PageMap(0, ())


def blob_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a blob name in a pagemap, or None when it can."""
    if not name:
        return "empty blob name"
    reason = _blob_name_reason(name)
    if reason is None:
        return None
    shown = repr(name[:40]) + ("…" if len(name) > 40 else "")  # reasons stay one short line
    return f"blob name {shown} {reason}"


def _blob_name_reason(name: str) -> str | None:
    if "/" in name:
        return "contains '/'"
    if "\0" in name:
        return "contains NUL"
    if name in (".", ".."):
        return "is reserved"
    if name.split() != [name]:  # the text form separates tokens by whitespace
        return "contains whitespace"
    if name.startswith((PAGE_BLOB_PREFIX, _PAGE_SIZE_KEY, _TOTAL_KEY)):
        return "starts with a reserved prefix"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    if len(encoded) > MAX_BLOB_NAME_BYTES:
        return f"is over {MAX_BLOB_NAME_BYTES} bytes"
    return None


def _check_value(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"pagemap: {what} must be an integer, got {value!r}")
    if value < 0:
        raise InvalidInput(f"pagemap: {what} {value} is negative")
    if value > MAX_PAGEMAP_VALUE:
        raise InvalidInput(f"pagemap: {what} {value} is not below 2**63")


def _check_page_size(page_size: int) -> None:
    _check_value("page_size", page_size)
    if page_size > MAX_PAGE_SIZE:
        raise InvalidInput(f"pagemap: page_size {page_size} is over 1 GiB")


def build(page_size: int, extents: Iterable[PageExtent]) -> PageMap:
    """Sort (stably, by page_off) and keep extents first-writer-wins; page size 0 becomes 1.

    Raises InvalidInput for values a pagemap may not hold (negative, >= 2**63, page size over
    1 GiB, bad blob names, more than MAX_PAGEMAP_EXTENTS extents).
    """
    _check_page_size(page_size)
    items = list(islice(extents, MAX_PAGEMAP_EXTENTS + 1))
    if len(items) > MAX_PAGEMAP_EXTENTS:
        raise InvalidInput(f"pagemap: more than {MAX_PAGEMAP_EXTENTS} extents")
    for e in items:
        problem = blob_name_problem(e.blob_name) if isinstance(e.blob_name, str) else "not a str"
        if problem is not None:
            raise InvalidInput(f"pagemap: {problem}")
        _check_value("blob_off", e.blob_off)
        _check_value("page_off", e.page_off)
        _check_value("size", e.size)
    return _check_slices(_build_checked(page_size, items))


def _build_checked(page_size: int, items: list[PageExtent]) -> PageMap:
    """The build walk over extents whose values are already known to be valid."""
    items.sort(key=lambda e: e.page_off)  # list.sort is stable: equal offsets keep input order
    kept: list[PageExtent] = []
    end = 0
    for e in items:
        if e.size == 0:
            continue
        if e.page_off < end:
            continue  # first writer wins: dropped whole, never trimmed
        kept.append(e)
        end = e.page_off + e.size
    return PageMap(page_size or 1, tuple(kept))


def max_slices_per_page(pagemap: PageMap) -> tuple[int, int]:
    """``(slices, page)``: the most slices any page of the map has, and the first such page.

    Kept extents are sorted and disjoint, so the slices of page ``p`` are the extents that
    start in ``p`` plus, at most, the one extent before them that runs into ``p``: one pass."""
    ps = pagemap.page_size
    if ps == 0 or not pagemap.extents:
        return 0, 0
    best, best_page = 1, pagemap.extents[0].page_off // ps
    i, extents = 0, pagemap.extents
    while i < len(extents):
        page = extents[i].page_off // ps
        j = i
        while j < len(extents) and extents[j].page_off // ps == page:
            j += 1
        count = j - i
        if i > 0 and (_extent_end(extents[i - 1]) - 1) // ps >= page:
            count += 1  # the extent before runs into this page
        if count > best:
            best, best_page = count, page
        i = j
    return best, best_page


def _check_slices(pagemap: PageMap) -> PageMap:
    slices, page = max_slices_per_page(pagemap)
    if slices > MAX_PAGE_SLICES:
        raise InvalidInput(
            f"pagemap: page {page} has {slices} slices, over the limit of {MAX_PAGE_SLICES}")
    return pagemap


def identity(page_size: int, total: int, chunk_size: int, blob_prefix: str) -> PageMap:
    """Lay ``total`` bytes stored as chunk blobs ``blob_prefix + str(i)`` onto page space 1:1.

    Chunk ``i`` holds bytes ``[i*chunk_size, (i+1)*chunk_size)`` of the range (the last one the
    remaining bytes), so page N is bytes ``[N*page_size, (N+1)*page_size)`` of the range for any
    page size, zero-padded past ``total``.
    """
    _check_value("total", total)
    _check_value("chunk_size", chunk_size)
    if chunk_size == 0:
        raise InvalidInput("pagemap: identity needs the effective chunk size, got 0")
    chunks = -(-total // chunk_size)
    if chunks > MAX_PAGEMAP_EXTENTS:
        raise InvalidInput(
            f"pagemap: {chunks} chunks is more than {MAX_PAGEMAP_EXTENTS} extents;"
            " use a larger chunk size"
        )
    _check_page_size(page_size)
    if -(-page_size // chunk_size) + 1 > MAX_PAGE_SLICES:
        raise InvalidInput(
            f"pagemap: pages of {page_size} bytes over {chunk_size}-byte chunks would have over "
            f"{MAX_PAGE_SLICES} slices each; use a larger chunk size or a smaller page size")
    # Names differ only in their digits, so the first and the longest speak for all of them.
    for name in (f"{blob_prefix}0", f"{blob_prefix}{max(chunks - 1, 0)}"):
        problem = blob_name_problem(name)
        if problem is not None:
            raise InvalidInput(f"pagemap: {problem}")
    extents = [
        PageExtent(f"{blob_prefix}{i}", 0, i * chunk_size, min(chunk_size, total - i * chunk_size))
        for i in range(chunks)
    ]
    return _build_checked(page_size, extents)


def _parse_uint(token: str) -> int | None:
    """A decimal token as an int, None when it is not one; InvalidInput when hostile."""
    if len(token) <= 18 and token.isascii() and token.isdigit():
        return int(token)  # fast path: 18 digits are always below 2**63
    if token.isascii() and token.isdigit():
        digits = token.lstrip("0")
        # 2**63 has 19 digits: a longer number is refused before int() sees it.
        if len(digits) > 19 or (digits and int(digits) > MAX_PAGEMAP_VALUE):
            raise InvalidInput(f"pagemap: value {token[:24]} is not below 2**63")
        return int(digits) if digits else 0
    if token[:1] == "-" and token[1:].isascii() and token[1:].isdigit():
        raise InvalidInput(f"pagemap: negative value {token[:24]}")
    return None


def _parse(text: str, strict: bool) -> PageMap:
    if len(text) > MAX_PAGEMAP_TEXT:
        raise InvalidInput(f"pagemap: text is over {MAX_PAGEMAP_TEXT} characters")
    if text.count("\n") >= MAX_PAGEMAP_LINES:
        raise InvalidInput(f"pagemap: more than {MAX_PAGEMAP_LINES} lines")
    page_size: int | None = None
    extents: list[PageExtent] = []
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line == _HEADER or line.startswith(_TOTAL_KEY):
            continue  # total is recomputed from the extents
        if line.startswith(_PAGE_SIZE_KEY):
            value = _parse_uint(line[len(_PAGE_SIZE_KEY) :])
            if value is None:
                raise InvalidInput(f"pagemap: line {lineno}: page_size is not a number")
            if value > MAX_PAGE_SIZE:
                raise InvalidInput(f"pagemap: line {lineno}: page_size {value} is over 1 GiB")
            page_size = value  # last wins
            continue
        tokens = line.split(None, 4)  # extra tokens are ignored, so never split them all
        if len(tokens) >= 4:
            # A negative or too large number in any of the three places refuses the map.
            blob_off = _parse_uint(tokens[1])
            page_off = _parse_uint(tokens[2])
            size = _parse_uint(tokens[3])
        else:
            blob_off = page_off = size = None
        if blob_off is None or page_off is None or size is None:
            if strict:
                raise InvalidInput(
                    f"pagemap: line {lineno}: expected 'blob_name blob_off page_off size'"
                )
            continue  # upstream skips a line that is not an extent
        problem = blob_name_problem(tokens[0])
        if problem is not None:
            raise InvalidInput(f"pagemap: line {lineno}: {problem}")
        extents.append(PageExtent(tokens[0], blob_off, page_off, size))
        if len(extents) > MAX_PAGEMAP_EXTENTS:
            raise InvalidInput(f"pagemap: more than {MAX_PAGEMAP_EXTENTS} extents")
    if page_size is None:
        raise InvalidInput("pagemap: no page_size line")
    if page_size == 0:
        raise InvalidInput("pagemap: page_size is 0")
    # every value was checked as it was read; a page of too many slices refuses the map
    return _check_slices(_build_checked(page_size, extents))


def parse(text: str) -> PageMap:
    """Read the text form the way upstream does: malformed or hostile text gives EMPTY_PAGEMAP.

    Lines that are not extents are skipped; never raises.
    """
    try:
        return _parse(text, strict=False)
    except InvalidInput:
        return EMPTY_PAGEMAP


def parse_strict(text: str) -> PageMap:
    """Read the text form for a writer: any line ``parse`` would skip or any hostile value
    raises InvalidInput with a one-line reason, so a bad map is refused and nothing changes.
    """
    return _parse(text, strict=True)
