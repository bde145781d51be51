"""An HDF5 reader's next reads through ``faultfs::``: each object's reads are served to the
HDF5 read planning (``faultfs.hdf5``: its chunk index, its groups' listings and links), as a
mount's engine serves its own, and the chunks it names are faulted ahead (DESIGN §15, §18).

Invariants:
- Planning never fails a read nor holds one up: an error is counted (``hdf5_errors``) and the
  guess dropped; a read another thread is planning from is not planned from; an object whose
  first bytes are no HDF5 file is planned from no more (one dictionary lookup a read).
- Each chunk is planned once per object (``PLANNED_KEPT`` remembered): a chunk the store did
  not take lives in the object's flights alone, and planning it again once its flight went
  past the kept ones would read it from the source again.
- A process keeps ``HDF5_AHEAD`` planned faults in flight at most, and half its pool
  (``PlannedFlights``): a reader's own fault never queues behind more than that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from faultfs.core.chunks import ChunkLayout
from faultfs.errors import InvalidInput
from faultfs.hdf5 import Hdf5Lookahead, Stats

if TYPE_CHECKING:
    from faultfs.fsspec.landing import Landing

log = logging.getLogger("faultfs.fsspec")

HDF5_AHEAD = 8  # planned faults in flight in a process at once, at most
PLANNED_KEPT = 4096  # chunks an object remembers it planned


class PlannedFlights:
    """The faults planning started in a process, of every object, not landed yet:
    ``HDF5_AHEAD`` at most, and half the pool's ``workers``, so a reader's own fault never
    queues behind more than that."""

    def __init__(self, workers: int) -> None:
        self.limit = min(HDF5_AHEAD, max(1, workers // 2))
        self.flights: list[Landing] = []
        self.lock = threading.Lock()

    def room(self) -> int:
        """How many more planned faults may start now."""
        with self.lock:
            self.flights = [f for f in self.flights if not f.done()]
            return max(0, self.limit - len(self.flights))

    def started(self, flight: Landing) -> None:
        with self.lock:
            self.flights.append(flight)


class Process(Protocol):
    """What a process's objects share that planning uses (``objects.Shared``)."""

    @property
    def stats(self) -> Stats: ...

    @property
    def planned(self) -> PlannedFlights: ...


@dataclass(frozen=True)
class _View:
    """An object as the HDF5 read planning sees it: one file, cut in chunks."""

    id: int
    layout: ChunkLayout


class Planner:
    """One object's HDF5 read planning, and the faults it starts: ``wanted(index)`` says
    whether a chunk is one to fault (not here, not on its way), ``fault(index, at=...)``
    starts one."""

    def __init__(self, layout: ChunkLayout, process: Process, wanted: Callable[[int], bool],
                 fault: Callable[..., Landing]) -> None:
        self.view = _View(0, layout)
        self.process = process
        self.wanted = wanted
        self.fault = fault
        self.lookahead: Hdf5Lookahead | None = Hdf5Lookahead(self._start, process.stats)
        self.lock = threading.Lock()
        self.once: set[int] = set()  # chunks planned already

    @classmethod
    def of(cls, size: int, chunk_size: int, process: Process, wanted: Callable[[int], bool],
           fault: Callable[..., Landing]) -> Planner | None:
        """A planner for an object of ``size`` bytes in ``chunk_size`` chunks (None: no
        layout for it)."""
        try:
            return cls(ChunkLayout(0, size, chunk_size), process, wanted, fault)
        except InvalidInput:
            return None

    def served(self, start: int, data: bytes | memoryview) -> None:
        """Bytes ``[start, start+len(data))`` of the object were read."""
        planner = self.lookahead
        if planner is None or not data or (start and not planner.maps):
            return
        if not self.lock.acquire(blocking=False):
            return
        try:
            planner.served(self.view, start, data)
            if not planner.maps and len(data) >= 16:  # its first bytes: no HDF5 file
                self.lookahead = None
        except Exception:  # a guess gone wrong costs the guess, never the read
            log.debug("planning an HDF5 reader's next reads failed", exc_info=True)
            self.process.stats.add("hdf5_errors")
        finally:
            self.lock.release()

    def _start(self, view: object, wanted: list[tuple[int, int]], urgent: bool) -> int:
        """Fault the chunks ``wanted`` (index, the first byte wanted: a fault starts there,
        so an object header deep in a chunk lands in one round trip), in order, as far as
        there is room (the next read plans the rest again) or all of them when ``urgent``;
        how many started."""
        room = self.process.planned.room()
        started = 0
        for index, at in wanted:
            if started >= room and not urgent:
                break
            if index in self.once or index >= self.view.layout.num_blobs:
                continue
            if len(self.once) < PLANNED_KEPT:
                self.once.add(index)
            if self.wanted(index):
                self.process.planned.started(self.fault(index, at=at))
                started += 1
        return started
