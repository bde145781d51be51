"""ExtentMap: the bytes written over a base, by offset — what a dirty blob holds until it is
folded into a file of its own.

Invariants:
- Extents are sorted by start, non-empty and never overlap; a later write wins over every
  byte it covers (earlier extents are trimmed or split, never merged into the new one).
- An extent holds bytes, or ``None`` for zeros (a truncation or a zeroed range costs no
  memory).
- ``overlay(buf, off)`` leaves every byte of ``buf`` no extent covers as it was (the base).
- ``held`` is the number of bytes held in memory (zero extents hold none).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator

Bytes = bytes | bytearray | memoryview


class ExtentMap:
    __slots__ = ("_datas", "_ends", "_starts", "held")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._datas: list[bytes | None] = []
        self.held = 0

    def __bool__(self) -> bool:
        return bool(self._starts)

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def end(self) -> int:
        """One past the last byte any extent covers (0 when empty)."""
        return self._ends[-1] if self._ends else 0

    def write(self, off: int, data: Bytes) -> None:
        """Bytes ``data`` at ``off``."""
        if data:
            self._put(off, off + len(data), bytes(data))

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

    def pieces(self, off: int, size: int) -> Iterator[tuple[int, int, bytes | None]]:
        """``(start, length, data or None)`` of the parts of extents inside ``[off, off+size)``."""
        end = off + size
        i = bisect_right(self._ends, off)
        while i < len(self._starts) and self._starts[i] < end:
            s, e, data = self._starts[i], self._ends[i], self._datas[i]
            lo, hi = max(s, off), min(e, end)
            yield lo, hi - lo, None if data is None else data[lo - s:hi - s]
            i += 1

    def overlay(self, buf: bytearray | memoryview, off: int) -> None:
        """Lay the extents over ``buf``, which holds base bytes ``[off, off+len(buf))``."""
        view = memoryview(buf)
        for start, length, data in self.pieces(off, len(view)):
            view[start - off:start - off + length] = bytes(length) if data is None else data

    def covers(self, off: int, size: int) -> bool:
        """Whether extents cover every byte of ``[off, off+size)`` (no base byte shows)."""
        end, pos = off + size, off
        i = bisect_right(self._ends, off)
        while pos < end and i < len(self._starts) and self._starts[i] <= pos:
            pos = self._ends[i]
            i += 1
        return pos >= end

    def items(self) -> Iterator[tuple[int, int, bytes | None]]:
        """Every extent: ``(start, length, data or None)``."""
        for s, e, data in zip(self._starts, self._ends, self._datas, strict=True):
            yield s, e - s, data

    # -- internals -----------------------------------------------------------------------

    def _put(self, start: int, end: int, data: bytes | None) -> None:
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

    def _insert(self, i: int, start: int, end: int, data: bytes | None) -> None:
        self._starts.insert(i, start)
        self._ends.insert(i, end)
        self._datas.insert(i, data)
        if data is not None:
            self.held += end - start

    def _drop(self, i: int) -> None:
        if self._datas[i] is not None:
            self.held -= self._ends[i] - self._starts[i]
        del self._starts[i], self._ends[i], self._datas[i]

    def _trim(self, i: int, start: int, end: int) -> None:
        """Keep only ``[start, end)`` of extent ``i`` (inside it)."""
        s, e, data = self._starts[i], self._ends[i], self._datas[i]
        if data is not None:
            self.held -= (e - s) - (end - start)
            data = data[start - s:end - s]
        self._starts[i], self._ends[i], self._datas[i] = start, end, data
