"""ExtentMap: the bytes written over a base, by offset — what a dirty blob holds until it is
folded into a file of its own.

Invariants:
- Extents are sorted by start, non-empty and never overlap; a later write wins over every
  byte it covers (earlier extents are trimmed or split, never merged into the new one).
- An extent holds bytes, a ``Ref`` (where its bytes lie in a file, with the bytes themselves
  while they are held in memory), or ``None`` for zeros (a truncation or a zeroed range costs
  no memory).
- ``overlay(buf, off)`` leaves every byte of ``buf`` no extent covers as it was (the base).
- ``held`` is the number of bytes held in memory: bytes extents and the refs not spilled
  (zero extents and spilled refs hold none). ``spill`` lets go of every ref's bytes.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator

Bytes = bytes | bytearray | memoryview


class Ref:
    """Bytes ``[lo, hi)`` of a record's data, which lies at ``pos`` (``length`` bytes, with
    checksum ``digest``) in file ``file`` (a key the owner of the file resolves: the map never
    reads it). ``data``: those bytes while they are held in memory, None once spilled."""

    __slots__ = ("data", "digest", "file", "hi", "length", "lo", "pos")

    def __init__(self, file: int, pos: int, length: int, digest: int, lo: int, hi: int,
                 data: bytes | None) -> None:
        self.file, self.pos, self.length, self.digest = file, pos, length, digest
        self.lo, self.hi, self.data = lo, hi, data

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, part: slice) -> Ref:
        """The ref of bytes ``[part.start, part.stop)`` of these (no step, no negatives)."""
        start = 0 if part.start is None else part.start
        stop = self.hi - self.lo if part.stop is None else part.stop
        data = None if self.data is None else self.data[start:stop]
        return Ref(self.file, self.pos, self.length, self.digest, self.lo + start,
                   self.lo + stop, data)


Data = bytes | Ref | None


def spilled(data: Data) -> bool:
    """Whether ``data`` is a ref whose bytes were let go of (they must be read back)."""
    return type(data) is Ref and data.data is None


def _held(data: Data, n: int) -> int:
    """Bytes of memory an extent of ``n`` bytes holding ``data`` takes."""
    return 0 if data is None or spilled(data) else n


class ExtentMap:
    __slots__ = ("_datas", "_ends", "_starts", "held")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._datas: list[Data] = []
        self.held = 0

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def end(self) -> int:
        """One past the last byte any extent covers (0 when empty)."""
        return self._ends[-1] if self._ends else 0

    def write(self, off: int, data: Bytes | Ref) -> None:
        """Bytes ``data`` (or the bytes a ``Ref`` names) at ``off``."""
        if len(data):
            self._put(off, off + len(data), data if isinstance(data, Ref) else bytes(data))

    def zero(self, off: int, size: int) -> None:
        """Zeros over ``[off, off+size)``."""
        if size > 0:
            self._put(off, off + size, None)

    def cut(self, size: int) -> None:
        """Forget everything at or past ``size`` (a truncation; the caller zeroes the base)."""
        i = bisect_left(self._ends, size + 1)  # the first extent ending past size
        if i < len(self._starts) and self._starts[i] < size:
            self._trim(i, self._starts[i], size)
            i += 1
        for j in range(len(self._starts) - 1, i - 1, -1):
            self._drop(j)

    def pieces(self, off: int, size: int) -> Iterator[tuple[int, int, Data]]:
        """``(start, length, data or None)`` of the parts of extents inside ``[off, off+size)``
        (a part of a ``Ref`` is a ``Ref``)."""
        end = off + size
        i = bisect_right(self._ends, off)
        while i < len(self._starts) and self._starts[i] < end:
            s, e, data = self._starts[i], self._ends[i], self._datas[i]
            lo, hi = max(s, off), min(e, end)
            yield lo, hi - lo, None if data is None else data[lo - s:hi - s]
            i += 1

    def overlay(self, buf: bytearray | memoryview, off: int,
                resolve: Callable[[Ref], bytes] | None = None) -> None:
        """Lay the extents over ``buf``, which holds base bytes ``[off, off+len(buf))``;
        ``resolve`` reads the bytes of a spilled ``Ref``."""
        lay(buf, off, self.pieces(off, len(buf)), resolve)

    def spill(self, longest: int) -> int:
        """Let go of the bytes of every ref to data of at most ``longest`` bytes (they are in
        its file: reading them back reads and verifies all of them); the bytes let go."""
        freed = 0
        for i, data in enumerate(self._datas):
            if type(data) is Ref and data.data is not None and data.length <= longest:
                data.data = None
                freed += self._ends[i] - self._starts[i]
        self.held -= freed
        return freed

    def covers(self, off: int, size: int) -> bool:
        """Whether extents cover every byte of ``[off, off+size)`` (no base byte shows)."""
        end, pos = off + size, off
        i = bisect_right(self._ends, off)
        while pos < end and i < len(self._starts) and self._starts[i] <= pos:
            pos = self._ends[i]
            i += 1
        return pos >= end

    def items(self) -> Iterator[tuple[int, int, Data]]:
        """Every extent: ``(start, length, data or None)``."""
        for s, e, data in zip(self._starts, self._ends, self._datas, strict=True):
            yield s, e - s, data

    # -- internals -----------------------------------------------------------------------

    def _put(self, start: int, end: int, data: Data) -> None:
        i = bisect_right(self._ends, start)  # the first extent ending after start
        if i < len(self._starts) and self._starts[i] < start:
            if self._ends[i] > end:  # the new bytes land inside one extent: split it
                s, e, old = self._starts[i], self._ends[i], self._datas[i]
                self._trim(i, s, start)
                self._insert(i + 1, end, e, None if old is None else old[end - s:])
            else:
                self._trim(i, self._starts[i], start)
            i += 1
        while i < len(self._starts) and self._ends[i] <= end:
            self._drop(i)  # covered whole
        if i < len(self._starts) and self._starts[i] < end:
            self._trim(i, end, self._ends[i])  # the new bytes cover its head
        self._insert(i, start, end, data)

    def _insert(self, i: int, start: int, end: int, data: Data) -> None:
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        self._datas.insert(i, data)
        self.held += _held(data, end - start)

    def _drop(self, i: int) -> None:
        self.held -= _held(self._datas[i], self._ends[i] - self._starts[i])
        del self._starts[i], self._ends[i], self._datas[i]

    def _trim(self, i: int, start: int, end: int) -> None:
        """Keep only ``[start, end)`` of extent ``i`` (inside it)."""
        s, e, data = self._starts[i], self._ends[i], self._datas[i]
        if data is not None:
            self.held -= _held(data, (e - s) - (end - start))
            data = data[start - s:end - s]
        self._starts[i], self._ends[i], self._datas[i] = start, end, data


def lay(buf: bytearray | memoryview, off: int, parts: Iterable[tuple[int, int, Data]],
        resolve: Callable[[Ref], bytes] | None = None) -> None:
    """Lay ``parts`` (``pieces`` of a map, perhaps taken earlier) over ``buf``, which holds
    bytes ``[off, off+len(buf))``; ``resolve`` reads the bytes of a spilled ``Ref``."""
    view = memoryview(buf)
    for start, length, data in parts:
        piece: bytes | None
        if isinstance(data, Ref):
            piece = data.data  # once: a spill may let go of it meanwhile (another thread)
            if piece is None:
                if resolve is None:
                    raise ValueError("a spilled extent needs a resolver")
                piece = resolve(data)
        else:
            piece = data
        view[start - off:start - off + length] = bytes(length) if piece is None else piece
