"""Chunk arithmetic: blob index <-> byte range of the source, and view ranges -> blob pieces.

For effective chunk size ``cs``, range ``[r0, r1)``: blob ``i`` holds source bytes
``[r0 + i*cs, min(r0 + (i+1)*cs, r1))``; a short final blob is zero-filled to ``cs``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from faultfs.core.context import MAX_CHUNK_SIZE, MAX_INT
from faultfs.core.inodes import MAX_INDEX
from faultfs.core.names import parse_index
from faultfs.errors import InvalidInput

MAX_BLOB_INDEX = MAX_INDEX  # inode numbers carry the index


@dataclass(frozen=True)
class ChunkLayout:
    """How a source range is cut into equal blobs named ``prefix + str(index)``."""

    range_off: int
    range_end: int
    chunk_size: int
    blob_prefix: str = "chunk_"

    def __post_init__(self) -> None:
        if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidInput(f"chunk size {self.chunk_size} is not in (0, 1 GiB]")
        if not 0 <= self.range_off <= self.range_end <= MAX_INT:
            raise InvalidInput(f"range [{self.range_off}, {self.range_end}) is not valid")
        if self.num_blobs - 1 > MAX_BLOB_INDEX:
            raise InvalidInput(f"{self.num_blobs} blobs is more than a tag can hold")

    @property
    def size(self) -> int:
        """Bytes of source in the range (the whole-object view's exact size)."""
        return self.range_end - self.range_off

    @property
    def num_blobs(self) -> int:
        return -(-self.size // self.chunk_size)

    def blob_name(self, index: int) -> str:
        return f"{self.blob_prefix}{index}"

    def blob_index(self, name: str) -> int | None:
        """The index named by ``name``, or None when it names no blob of this layout.

        Only the canonical decimal form counts: ``chunk_7`` is blob 7, ``chunk_07`` is nothing.
        """
        if not name.startswith(self.blob_prefix):
            return None
        index = parse_index(name[len(self.blob_prefix):])
        return index if index is not None and index < self.num_blobs else None

    def source_range(self, index: int) -> tuple[int, int]:
        """Source bytes ``[start, end)`` blob ``index`` holds (end - start <= chunk_size)."""
        if not 0 <= index < self.num_blobs:
            raise InvalidInput(f"blob index {index} is outside [0, {self.num_blobs})")
        start = self.range_off + index * self.chunk_size
        return start, min(start + self.chunk_size, self.range_end)

    def coalesce(self, first: int, count: int) -> int:
        """Adjacent chunks are adjacent source bytes, so any run of them is one source read."""
        return max(0, min(count, self.num_blobs - first))

    def view_pieces(self, off: int, size: int) -> list[tuple[int, int, int]]:
        """Cut view bytes ``[off, off+size)`` (clipped to the view) into
        ``(blob_index, offset_in_blob, length)`` pieces, in order."""
        return pieces(off, size, self.size, self.chunk_size)


def pieces(off: int, size: int, total: int, chunk_size: int) -> list[tuple[int, int, int]]:
    """Bytes ``[off, off+size)`` of a ``total``-byte run of ``chunk_size`` chunks (clipped to
    ``total``), as ``(chunk_index, offset_in_chunk, length)`` pieces in order."""
    if off < 0 or size < 0:
        raise InvalidInput(f"negative view range ({off}, {size})")
    end = min(off + size, total)
    out = []
    pos = off
    while pos < end:
        index, inner = divmod(pos, chunk_size)
        length = min(chunk_size - inner, end - pos)
        out.append((index, inner, length))
        pos += length
    return out


def zero_fill(data: bytes | memoryview, size: int) -> bytes | memoryview:
    """``data`` padded with zeros to ``size`` bytes (a short final blob); ``data`` itself
    when it is already that long."""
    if len(data) > size:
        raise InvalidInput(f"{len(data)} bytes do not fit a blob of {size}")
    if len(data) == size:
        return data
    return bytes(data) + bytes(size - len(data))


def here_bits(chunks: int, source: int, here: Callable[[int], bool]) -> bytes:
    """A bitmap of ``chunks`` chunks (chunk i: bit ``i % 8``, least significant first, of
    byte ``i // 8``): ``here(i)`` for the first ``source``; past them every chunk is the
    writes' (however far the view grew), all set, whole bytes at once."""
    bits = bytearray((chunks + 7) // 8)
    source = min(chunks, source)
    for index in range(source):
        if here(index):
            bits[index >> 3] |= 1 << (index & 7)
    lo, hi = -(-source // 8), chunks // 8
    if hi > lo:
        bits[lo:hi] = b"\xff" * (hi - lo)
    for index in (*range(source, min(chunks, lo * 8)), *range(max(hi * 8, source), chunks)):
        bits[index >> 3] |= 1 << (index & 7)
    return bytes(bits)
