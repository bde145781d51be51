"""The plan of a shuffled epoch: which records a reader delivers, window by window, and the
order each window's records are mixed in. Arithmetic only: a pure function of the seed, the
epoch, the shard sizes, the geometry and the readers, so every reader, every node and every
restart computes the same plan without asking anyone.

An epoch, for seed S and epoch E (docs/FORMAT-cursors.md, "Shuffled streams"):
- The shards are put in a seeded order (``permutation``), and their bytes concatenated in
  that order. That byte space is cut into blocks of ``block_bytes``; block ``b`` covers
  ``[b * block_bytes, (b + 1) * block_bytes)`` and owns the records that *start* in it (a
  line that crosses the block's end is read whole by the block it starts in; a Parquet row
  group belongs to the block that holds its position, see ``readers.row_group_positions``).
  A block may span the end of one shard and the start of the next; an empty shard has none.
- The blocks are put in a seeded order and dealt to the readers (ranks x workers) like cards:
  reader ``i`` of ``R`` gets ``blocks[i::R]``, so every record is in exactly one reader's part
  and parts differ by at most one block. Each reader cuts its blocks, in that order, into
  ``ceil(blocks / window_blocks)`` windows of consecutive ones, of sizes that differ by one
  block at most (sorted in a window, so a window is read in byte order).
- A window's records are numbered in its blocks' order, each block's in file order, and
  delivered in the order of a seeded permutation of those numbers (``permutation`` with the
  window's own key).
- After a repartition in the middle of an epoch, the rest of that epoch is a ``Carried``
  plan (the windows some reader had begun, each from where it stopped, and the blocks no
  reader began), dealt the same way to the new readers; later epochs are pure again.

Invariants:
- ``permutation(key, n)`` is a permutation of ``range(n)`` that depends on ``key`` and ``n``
  alone: fixed integer arithmetic (a Fisher-Yates shuffle driven by splitmix64), not numpy's
  generators, whose streams may change between versions (a golden test pins it).
- Every block of an epoch is in exactly one reader's windows (pure or carried), once.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import xxhash

WINDOW_BLOCKS = 16  # blocks per window: a window mixes records from 16 places of the corpus
# (from as many shards), and a resume re-reads at most this many blocks
DEFAULT_WINDOW = 1 << 20  # bytes: 64 KiB blocks. A resume reads one window again (~5-10 ms
# here, flat); a window's 16 blocks come from 16 places of the corpus whatever its size. A
# remote source wants larger blocks (each is one range request): pass a larger window

# what a key is for: keys of different purposes never coincide
_SHARDS, _BLOCKS, _WINDOW, _CARRIED = 1, 2, 3, 4
_KEY_SEED = 0x66617573686666  # "faulshff": the domain of our permutation keys
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U64 = (1 << 64) - 1

try:  # the compiled permutation (setup.py); optional: the same permutation in Python below
    from faultfs.stream._cut import permutation as _c_permutation
except ImportError:  # pragma: no cover - built wherever a compiler is
    _c_permutation = None


def key_of(*parts: int) -> int:
    """A 64-bit key for a permutation: xxh3_64 of ``parts`` as little-endian u64s."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(parts)}Q", *parts), seed=_KEY_SEED)


def permutation(key: int, n: int) -> np.ndarray:
    """A seeded permutation of ``range(n)`` as ``int64``: the Fisher-Yates shuffle driven by
    splitmix64 seeded with ``key`` — for ``i`` from ``n - 1`` down to 1, swap ``i`` with
    ``(r * (i + 1)) >> 64`` for the generator's next output ``r``. Fixed integer arithmetic,
    so the same on every machine and version (a golden test pins it); in C where it is
    built (``faultfs.stream._cut``, ~3 ns per element, without the GIL), else in Python."""
    if _c_permutation is not None:
        return np.frombuffer(_c_permutation(key, n), dtype=np.int64)
    return python_permutation(key, n)


def python_permutation(key: int, n: int) -> np.ndarray:
    """``permutation`` in Python (~0.5 us per element): where the C path is not built."""
    p = list(range(n))
    state = key & _U64
    for i in range(n - 1, 0, -1):
        state = (state + _GOLDEN) & _U64
        z = ((state ^ (state >> 30)) * _M1) & _U64
        z = ((z ^ (z >> 27)) * _M2) & _U64
        z ^= z >> 31
        j = (z * (i + 1)) >> 64
        p[i], p[j] = p[j], p[i]
    return np.array(p, dtype=np.int64)


@dataclass(frozen=True)
class Geometry:
    """The shape of a shuffled stream, fixed for its life (recorded in its sidecar)."""

    seed: int
    block_bytes: int
    window_blocks: int = WINDOW_BLOCKS

    @classmethod
    def for_window(cls, seed: int, window_bytes: int) -> Geometry:
        return cls(seed, max(1, window_bytes // WINDOW_BLOCKS), WINDOW_BLOCKS)

    @property
    def window_bytes(self) -> int:
        return self.block_bytes * self.window_blocks


@dataclass(frozen=True)
class WindowSpec:
    """One window of a reader's epoch: its blocks (their records numbered in this order), the
    key of its permutation, and the positions of that permutation delivered before the
    current plan began (a window carried over a repartition; 0 otherwise)."""

    blocks: tuple[int, ...]
    key: int
    start: int = 0


class EpochGrid:
    """The blocks of one epoch: the seeded shard order and the byte ranges each block covers."""

    def __init__(self, sizes: Sequence[int], seed: int, epoch: int, block_bytes: int) -> None:
        self.sizes = tuple(int(s) for s in sizes)
        self.seed, self.epoch, self.block_bytes = seed, epoch, block_bytes
        self.order = permutation(key_of(_SHARDS, seed, epoch), len(self.sizes))
        ordered = np.asarray(self.sizes, dtype=np.int64)[self.order]
        self.ends = np.cumsum(ordered)  # where each shard (in epoch order) ends
        self.starts = self.ends - ordered
        self.total = int(self.ends[-1]) if ordered.size else 0
        self.block_count = -(-self.total // block_bytes)

    def block_order(self) -> np.ndarray:
        """The blocks in their seeded order (8 bytes a block while a plan is made)."""
        return permutation(key_of(_BLOCKS, self.seed, self.epoch), self.block_count)

    def pieces(self, block: int) -> list[tuple[int, int, int | None]]:
        """The parts of shards block ``block`` covers: ``(shard_id, lo, hi)``, byte offsets in
        the shard, ``hi`` None for the shard's end. Empty shards are never in a block."""
        lo_global = block * self.block_bytes
        hi_global = min(lo_global + self.block_bytes, self.total)
        out: list[tuple[int, int, int | None]] = []
        i = int(np.searchsorted(self.ends, lo_global, side="right"))
        while i < self.order.size and self.starts[i] < hi_global:
            start, size = int(self.starts[i]), int(self.ends[i] - self.starts[i])
            lo, hi = max(lo_global - start, 0), min(hi_global - start, size)
            if lo < hi:
                out.append((int(self.order[i]), lo, None if hi == size else hi))
            i += 1
        return out


@dataclass(frozen=True)
class Carried:
    """The rest of an epoch after a repartition inside it (``carry.py`` makes it): the windows
    some reader had begun, each from the position it had reached, and the blocks no reader
    had begun (``pool``: one flag per block of the epoch's grid)."""

    generation: int
    epoch: int
    remainders: tuple[WindowSpec, ...]
    pool: np.ndarray  # bool, one per block


class ReaderWindows(Sequence[WindowSpec]):
    """A reader's windows of an epoch, in order: the remainders it was dealt (a carried
    epoch), then its blocks cut in order into ``ceil(blocks / window_blocks)`` windows whose
    sizes differ by one block at most, each made when asked for (a reader keeps 8 bytes per
    block it was dealt, not a window object each)."""

    def __init__(self, remainders: Sequence[WindowSpec], blocks: np.ndarray,
                 window_blocks: int, keys: tuple[int, ...]) -> None:
        self._remainders = tuple(remainders)
        self._blocks = np.ascontiguousarray(blocks)
        self._w = window_blocks
        self._keys = keys  # a window's key: key_of(*keys, its index among the cut ones)
        # ceil(blocks / window_blocks) windows of nearly one size (they differ by one block at
        # most): no short last window of a block or two, whose records would come out as runs
        self._cut = -(-int(self._blocks.size) // window_blocks)
        self._len = len(self._remainders) + self._cut

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, k: int) -> WindowSpec: ...

    @overload
    def __getitem__(self, k: slice) -> list[WindowSpec]: ...

    def __getitem__(self, k: int | slice) -> WindowSpec | list[WindowSpec]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._len))]
        if k < 0:
            k += self._len
        if not 0 <= k < self._len:
            raise IndexError(k)
        if k < len(self._remainders):
            return self._remainders[k]
        k -= len(self._remainders)
        n = int(self._blocks.size)
        part = np.sort(self._blocks[k * n // self._cut : (k + 1) * n // self._cut])
        return WindowSpec(tuple(part.tolist()), key_of(*self._keys, k))


def reader_windows(
    grid: EpochGrid,
    geometry: Geometry,
    readers: int,
    reader: int,
    carried: Carried | None = None,
) -> ReaderWindows:
    """The windows reader ``reader`` of ``readers`` delivers in ``grid``'s epoch, in order:
    the pure plan, or (``carried``, of this epoch) its share of what a repartition carried."""
    seed, epoch, w = geometry.seed, grid.epoch, geometry.window_blocks
    order = grid.block_order()
    if carried is None:
        return ReaderWindows((), order[reader::readers], w,
                             (_WINDOW, seed, epoch, readers, reader))
    assert carried.epoch == epoch
    pool = order[carried.pool[order]]
    return ReaderWindows(carried.remainders[reader::readers], pool[reader::readers], w,
                         (_CARRIED, seed, epoch, carried.generation, readers, reader))
