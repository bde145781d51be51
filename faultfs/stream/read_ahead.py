"""Read-ahead: the next blocks of an open shard read, parsed and decided in worker threads.

Invariants:
- ``READ_AHEAD`` blocks are on their way at most: each is split (raw) or parsed (pyarrow
  parses without the GIL), hashed and decided (dedup), and its fresh records picked, while
  the consumer uses the block before it.
- The workers take turns on the reader, in block order (``_Turns``), and decide their blocks
  in that order too, so each is decided against every block before it; only they touch the
  reader and the delivered set while a read-ahead is in flight. Once a read found the
  reader's end (or failed), later turns read nothing.
- A block's error is raised when the stream takes that block (``next``), as without
  read-ahead; ``wait`` and ``close`` wait for every worker, their errors dropped.
- ``Pace`` says when read-ahead pays where the stream could do without it (a shuffled
  stream's raw records): only while the consumer leaves the CPU idle between batches. Read
  ahead or not, the same blocks are taken in the same order: it decides who makes them and
  when, never what they are.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from faultfs.stream.columns import block_table
from faultfs.stream.fresh import NO_HASHES, Dedup, Fresh, block_firsts, fresh_records
from faultfs.stream.readers import LineShardReader, ParquetShardReader, RecordBlock

READ_AHEAD = 2  # blocks on their way: two parses at once keep both of pyarrow's threads
# busy while the next block is read (and with dedup, one block's hashing overlaps another's read)

View = tuple[str, Any]  # the records' format ("raw" or "arrow") and schema (None for raw)
IDLE_SHARE = 0.5  # read ahead once the consumer's idle time between batches is this share of
# the stream's own time making them: the workers' hand-offs cost ~40 % more CPU than making
# the same records on the consumer's thread (a raw shuffled pass, 2 cores), won back only
# where a worker runs while the consumer waits (an fsync, a sleep, a GPU)


class Pace:
    """Whether the next block is made ahead, by the workers, or when it is needed, on the
    consumer's thread. Made ahead, a block's records are made while the consumer is away
    between batches, at the cost of the hand-offs; that pays only if the process has CPU to
    spare meanwhile (the consumer blocked in an fsync, a sleep or a device, not running
    Python). ``back``/``out`` mark the consumer's return for a batch and the batch going out;
    ``ahead`` decides from the batches since it last decided: idle time (the time away less
    the CPU the process used meanwhile) against the time taken to make them."""

    def __init__(self) -> None:
        self._busy = 0.0  # seconds making batches, since the last decision
        self._idle = 0.0  # seconds away with the process's CPU unused, since then
        self._back = 0.0
        self._away: tuple[float, float] | None = None  # (wall, process CPU) at the last out
        self.read_ahead = False

    def start(self) -> None:
        """A new ``batches()``: the time since the last batch went out is neither."""
        self._away = None
        self._back = time.perf_counter()

    def back(self) -> None:
        now = time.perf_counter()
        if self._away is not None:
            wall, cpu = self._away
            self._idle += max(0.0, now - wall - (time.process_time() - cpu))
            self._away = None
        self._back = now

    def out(self) -> None:
        now = time.perf_counter()
        self._busy += now - self._back
        self._away = (now, time.process_time())

    def ahead(self) -> bool:
        """Read the next block ahead? (Unchanged until a batch was made since it last said.)"""
        if self._busy > 0.0:
            self.read_ahead = self._idle >= IDLE_SHARE * self._busy
            self._busy = self._idle = 0.0
        return self.read_ahead


@dataclass(frozen=True)
class Ahead:
    """A block read ahead: its fresh records (decided in block order) in ``view``."""

    block: RecordBlock | None  # None: the reader's end
    fresh: Fresh = (None, NO_HASHES, 0)
    view: View = ("raw", None)
    records: Any = None


class _Turns:
    """The read-ahead workers' turns on one reader: ticket ``k`` reads the k-th block asked
    for, after ticket ``k - 1`` has read its own; once a read found the reader's end (or
    failed), later tickets read nothing. Dedup decisions take turns the same way
    (``in_order``), so that each block is decided against every block before it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._issued = 0
        self._turn = 0
        self._decided = 0
        self.ended = False

    def issue(self) -> int:
        self._issued += 1
        return self._issued - 1

    def take(self, ticket: int, read: Any) -> Any:
        with self._cond:
            while self._turn != ticket:
                self._cond.wait()
            try:
                if self.ended:
                    return None
                block = read()
                if block is None:
                    self.ended = True
                return block
            except BaseException:
                self.ended = True
                raise
            finally:
                self._turn += 1
                self._cond.notify_all()

    def in_order(self, ticket: int, work: Any) -> Any:
        """``work()`` (None: nothing) once every earlier ticket has passed its own turn
        here; each ticket passes once, also when it fails before it gets here."""
        with self._cond:
            while self._decided != ticket:
                self._cond.wait()
        try:
            return None if work is None else work()
        finally:
            with self._cond:
                self._decided += 1
                self._cond.notify_all()


class ReadAhead:
    """The blocks of one open reader on their way, and the worker threads that make them."""

    def __init__(self, dedup: Dedup) -> None:
        self._dedup = dedup
        self._ahead: deque[Future[Ahead]] = deque()
        self._turns: _Turns | None = None  # the workers' turns on the open reader
        self._pool: ThreadPoolExecutor | None = None
        self.pace = Pace()  # where read-ahead is the stream's choice (``Pace``)

    def __len__(self) -> int:
        """Blocks on their way."""
        return len(self._ahead)

    def next(self) -> Ahead | None:
        """The oldest block on its way (its error raised here), or None: none is."""
        return self._ahead.popleft().result() if self._ahead else None

    def start(self, reader: LineShardReader | ParquetShardReader, view: View) -> None:
        """Keep ``READ_AHEAD`` blocks of the open reader on their way, each split (raw) or
        parsed (``view``), hashed and decided (dedup), and its fresh records picked; the
        workers read and decide the blocks in turn, in the order they were asked for."""
        if not self._ahead:
            self._turns = _Turns()
        turns = self._turns
        assert turns is not None

        def work(ticket: int) -> Ahead:
            decided = False
            try:
                block = turns.take(ticket, reader.next_block)
                if block is None:
                    return Ahead(None)
                table = None if view[0] == "raw" else block_table(block, view[1])
                if self._dedup.dedup:
                    firsts = block_firsts(block)
                    decided = True
                    fresh = turns.in_order(ticket, lambda: self._dedup.decide(block, firsts))
                else:
                    fresh = self._dedup.decide(block)
                return Ahead(block, fresh, view, fresh_records(block, fresh, table))
            finally:
                if not decided:
                    turns.in_order(ticket, None)

        if self._pool is None:
            self._pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="faultfs-stream")
        while len(self._ahead) < READ_AHEAD and not turns.ended:
            self._ahead.append(self._pool.submit(work, turns.issue()))

    def wait(self) -> None:
        """Wait for every read-ahead in flight and drop them (their errors with them)."""
        while self._ahead:
            self._ahead.popleft().exception()
        self._turns = None

    def close(self) -> None:
        """Wait for the workers (they may be using the reader) and end their threads."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
