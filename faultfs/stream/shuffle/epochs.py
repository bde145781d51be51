"""A shuffled reader's epochs: which one it is in, the plan of its part of it, where it
resumes, and the shuffle slot each batch commits. The face's opener for a shuffled stream
(``first``/``after``/``open``, as ``opening.ShardOpener``): the epoch is one source of mixed
blocks (``window.EpochReader``).

Invariants:
- The stream's shuffle (seed, geometry) and shards (their URLs' fingerprint and sizes) are
  those its record holds; a state whose seed, window or shard list differs is refused in one
  line naming both, before a record is read. A state written by a stream that reads in file
  order is refused by a shuffling one, and the other way round (``opening``'s face).
- The epoch is the checkpoint's: the one its slot names, or the next when that one is
  finished. ``epoch=`` (or ``set_epoch``) may choose another only at the start of an epoch —
  nothing of it committed or handed out — and not at the start of the rest of an epoch a
  repartition carried over (that rest would be lost); elsewhere it is refused naming both.
- A resume reads the checkpoint's window again and continues at its position; with dedup
  the committed hashes of the epoch are those the WAL took since its start (``dedup_base``),
  with those a repartition carried into it: earlier epochs' hashes are neither read nor used.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import CorruptionError, InvalidInput
from faultfs.store.metadata import DualMetadataManager
from faultfs.stream.partition import (
    SHUFFLE_SUFFIX,
    ReaderPlan,
    fingerprint,
    load_base,
    shard_sizes,
)
from faultfs.stream.shards import Shard
from faultfs.stream.shuffle.carry import load_carried
from faultfs.stream.shuffle.plan import EpochGrid, Geometry, ReaderWindows, reader_windows
from faultfs.stream.shuffle.record import ShuffleHeader, ShuffleRecord, ShuffleSlot, read_record
from faultfs.stream.shuffle.window import EpochReader


def refuse_unshuffled_state(plan: ReaderPlan) -> None:
    """A stream that reads in file order refuses the state of a shuffled one."""
    path = plan.state_path + SHUFFLE_SUFFIX
    if os.path.lexists(path):
        raise InvalidInput(
            f"{plan.state_path} is the state of a shuffled stream (its shuffle record is "
            f"{path}); this stream reads in file order: open it with shuffle=True and its seed"
        )


class Epochs:
    """The epochs of one shuffled reader over its checkpoint (module doc)."""

    end = 1  # the epoch is the one source the face opens (``first``/``after``/``open``)

    def __init__(
        self,
        shards: Sequence[Shard],
        plan: ReaderPlan,
        meta: DualMetadataManager,
        state: str,
        geometry: Geometry,
        epoch: int | None,
    ) -> None:
        self.shards = shards
        self.geometry = geometry
        part = plan.partition
        self.generation = part.generation if part is not None else 0
        self.readers = plan.world_size * plan.num_workers
        self.index = plan.index
        self.path = plan.state_path + SHUFFLE_SUFFIX
        fp = fingerprint(shards)
        if read_record(self.path) is None:
            if not meta.is_fresh:
                raise InvalidInput(
                    f"{meta.meta_path} was written by a stream that reads in file order; this "
                    f"stream shuffles (seed {geometry.seed}): open it with shuffle=False, or "
                    "give the shuffled run a state of its own"
                )
            sizes = part.shard_sizes if part is not None else tuple(shard_sizes(shards))
            header = ShuffleHeader(geometry, fp, tuple(sizes))
            genesis = ShuffleSlot(0, epoch or 0, generation=self.generation)
            self.record = ShuffleRecord.create(self.path, header, genesis)
        else:
            self.record = ShuffleRecord.open(self.path, meta.epoch, meta.meta_path)
        try:
            self._check(part.shard_sizes if part is not None else None, fp)
            self.carried = (load_carried(state, part, geometry)
                            if part is not None and part.generation else None)
            self._place(meta, epoch)
        except BaseException:
            self.record.close()
            raise

    def _check(self, sizes: Sequence[int] | None, fp: int) -> None:
        """The state's shuffle and shards against the stream's (module doc)."""
        h, g, where = self.record.header, self.geometry, self.path
        if h.geometry.seed != g.seed:
            raise InvalidInput(f"{where}: the state was shuffled with seed {h.geometry.seed}; "
                               f"this stream has seed {g.seed}")
        if h.geometry != g:
            raise InvalidInput(
                f"{where}: the state was shuffled in windows of {h.geometry.window_bytes} bytes "
                f"({h.geometry.window_blocks} blocks); this stream has shuffle_window="
                f"{g.window_bytes}"
            )
        if h.fingerprint != fp or len(h.sizes) != len(self.shards):
            raise InvalidInput(
                f"{where}: the state was written over {len(h.sizes)} shards of "
                f"{sum(h.sizes)} bytes with other names; these sources expand to "
                f"{len(self.shards)} shards (a stream must be resumed with the same sources)"
            )
        if sizes is not None and tuple(sizes) != h.sizes:
            raise InvalidInput(
                f"{where}: the state was written over shards of {sum(h.sizes)} bytes; the "
                f"partition records {sum(sizes)} bytes (the sources changed)"
            )
        self.sizes = h.sizes
        slot = self.record.slot
        if slot.generation != self.generation:
            raise CorruptionError(
                f"{where}: the state follows the plan of partition generation "
                f"{slot.generation}; the partition is generation {self.generation}"
            )

    def _place(self, meta: DualMetadataManager, epoch: int | None) -> None:
        """The epoch this stream reads and where it resumes in it (module doc)."""
        slot = self.record.slot
        if slot.meta_epoch == 0:  # nothing committed yet
            current, at_start = slot.epoch, True
            bound = self.carried is not None and self.carried.epoch == current
        elif slot.finished:
            current, at_start, bound = slot.epoch + 1, True, False
        else:
            current, at_start, bound = slot.epoch, False, False
        if epoch is not None and epoch != current:
            if not at_start or bound:
                what = ("the rest of it a repartition carried over" if at_start
                        else f"at window {slot.window}, position {slot.position}")
                raise InvalidInput(
                    f"{self.path}: the state is in epoch {current} ({what}); this stream asks "
                    f"for epoch {epoch} — finish epoch {current} first"
                )
            current = epoch
        self._hashed_before = meta.dedup_count  # WAL hashes when this stream opened
        self.epoch = current
        self.bound = bound
        self.exhausted = False
        self.handed_out = False  # a batch of this epoch handed out by this stream
        self._windows: ReaderWindows | None = None
        self._grid: EpochGrid | None = None
        if at_start or current != slot.epoch:
            self.begun = False
            self.dedup_base = meta.dedup_count
            self.resume = (0, 0, 0)
            self.resume_coord = StreamCoordinate()
        else:
            self.begun = True
            self.dedup_base = slot.dedup_base
            windows = self.windows()
            if slot.window > len(windows) or slot.dedup_base > meta.dedup_count:
                raise CorruptionError(
                    f"{self.path}: the checkpoint is at window {slot.window} of a part of "
                    f"{len(windows)} windows, dedup base {slot.dedup_base} of "
                    f"{meta.dedup_count} hashes"
                )
            self.resume = (slot.window, slot.position, meta.coord.global_row_idx)
            self.resume_coord = meta.coord

    # -- the plan of the current epoch -----------------------------------------------------

    def _carried_now(self) -> object:
        c = self.carried
        return c if c is not None and c.epoch == self.epoch else None

    def windows(self) -> ReaderWindows:
        """This reader's windows of the current epoch, in order."""
        if self._windows is None:
            g = self.geometry
            self._grid = EpochGrid(self.sizes, g.seed, self.epoch, g.block_bytes)
            self._windows = reader_windows(
                self._grid, g, self.readers, self.index, self._carried_now()  # type: ignore[arg-type]
            )
        return self._windows

    def committed_hashes(self, meta: DualMetadataManager, state: str,
                         plan: ReaderPlan) -> np.ndarray | None:
        """The hashes delivered in the current epoch before the stream opened (None: none)."""
        out = []
        if self.begun and meta.dedup_count > self.dedup_base:
            out.append(meta.committed_hashes(self.dedup_base))  # this epoch's only
        part = plan.partition
        if self._carried_now() is not None and part is not None and part.base_count:
            out.append(load_base(state, part))
        if not out:
            return None
        return np.concatenate(out) if len(out) > 1 else np.array(out[0])

    # -- the face's opener -----------------------------------------------------------------

    def first(self) -> int:
        return 0

    def after(self, source: int) -> int:
        return source + 1

    def open(self, source: int, global_start: int) -> EpochReader:
        """The mixed blocks of the current epoch from where it resumes."""
        del source, global_start
        windows = self.windows()
        assert self._grid is not None
        window, position, global_row_idx = self.resume
        return EpochReader(self.shards, self._grid, windows, window, position, global_row_idx)

    # -- moving on -------------------------------------------------------------------------

    def next_epoch(self, epoch: int | None, hashed: int) -> None:
        """Start ``epoch`` (None: the next) from its start; ``hashed``: the hashes handed out
        by this stream so far (the WAL's count once they are committed)."""
        if epoch is not None and self.bound and not self.handed_out and epoch != self.epoch:
            raise InvalidInput(
                f"{self.path}: the state is in epoch {self.epoch} (the rest of it a "
                f"repartition carried over); this stream asks for epoch {epoch} — finish "
                f"epoch {self.epoch} first"
            )
        self.epoch = self.epoch + 1 if epoch is None else epoch
        self.dedup_base = self._hashed_before + hashed
        self.resume = (0, 0, 0)
        self.resume_coord = StreamCoordinate()
        self.begun = self.handed_out = self.exhausted = self.bound = False
        self._windows = self._grid = None

    @property
    def at_start(self) -> bool:
        """Nothing of the current epoch is committed or handed out."""
        return not self.begun and not self.handed_out

    # -- what a commit records -------------------------------------------------------------

    def slot_after(self, window: int, position: int, *, finished: bool = False) -> ShuffleSlot:
        """The shuffle slot of a batch that ends at ``position`` of ``window`` (``finished``:
        after the last record of the epoch); ``meta_epoch`` is set when it is committed."""
        if finished:
            window, position = len(self.windows()), 0
        return ShuffleSlot(0, self.epoch, window, position, self.dedup_base, self.generation,
                           finished)

    def close(self) -> None:
        self.record.close()
