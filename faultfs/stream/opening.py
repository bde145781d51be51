"""Opening a reader's shards: which it reads, in what order, each from where it resumes.

Invariants:
- Reopening continues with the first record after the last committed batch: only shard
  ``shard_id`` of the checkpoint is opened, at ``byte_offset`` (lines) or at row group
  ``row_group_idx`` with ``row_offset_in_page`` rows skipped (Parquet). No earlier shard is
  opened, read or hashed.
- Shards are read in the order of the expanded source list, those that hold none of a
  partitioned reader's records skipped unopened: the order is decided here alone (``first``,
  ``after``).
- A partitioned reader (``faultfs.stream.partition``) reads only its records of a shard, in
  the same order, and resumes only from a checkpoint that can be one of its own commits
  (``resumes_in``): one inside its part, or past the end of one of its ranges by no more than
  the line that crosses that end (that line is read from its end back, only then). Anything
  else (the state of another reader) is refused, naming the state and the reader, before a
  record is delivered: when the opener is made, or when the checkpoint's shard is opened (a
  Parquet checkpoint needs its footer, a line past a range's end its bytes).
- A shard a partitioned reader opens has the size its partition recorded (``SourceError``
  otherwise, from the reader).
"""

from __future__ import annotations

from bisect import bisect_left

from faultfs.core.coord import StreamCoordinate
from faultfs.errors import InvalidInput
from faultfs.stream.partition import ReaderPlan, shard_pieces
from faultfs.stream.readers import LineRange, LineShardReader, ParquetShardReader, Piece
from faultfs.stream.shards import Shard


def resumes_in(pieces: list[Piece], key: tuple[int, int]) -> bool:
    """Whether a checkpoint at ``key`` (``(byte offset, 0)`` in a line shard, ``(position of
    the row group, rows of it consumed)`` in a Parquet shard) lies in one of ``pieces``: after
    its start, at or before its end. A commit is just after a record the reader owns, whose
    key is at or after its piece's start and before its end, so every checkpoint of a reader
    lies in one of its pieces but one: the line that crosses a piece's end is read whole, and
    the checkpoint after it lies past that end (there ``owns`` of the line ending at the
    checkpoint decides)."""
    return any(a < key and (b is None or key <= b) for a, b in pieces)


def owns(pieces: list[Piece], key: tuple[int, int]) -> bool:
    """Whether the record whose key is ``key`` is in one of ``pieces``."""
    return any(a <= key and (b is None or key < b) for a, b in pieces)


def line_ranges(pieces: list[Piece], resume: int | None) -> list[LineRange]:
    """A line shard's pieces (partition keys) as the byte ranges of the line starts they own,
    from ``resume`` (a line start: the offset just after the last committed record) on."""
    ranges: list[LineRange] = []
    for (a_pos, a_row), b in pieces:
        lo = a_pos + (1 if a_row else 0)  # a line's key is (its first byte, 0)
        stop = None if b is None else b[0] + (1 if b[1] else 0)
        if resume is not None:
            if stop is not None and stop <= resume:
                continue
            if resume >= lo:
                ranges.append((resume, stop, True))
                continue
        ranges.append((lo, stop, lo == 0))
    return ranges


class ShardOpener:
    """The shards of one reader, in the order it reads them, each opened where it resumes."""

    def __init__(
        self, shards: list[Shard], plan: ReaderPlan, meta_path: str, resume: StreamCoordinate
    ) -> None:
        """``resume``: the checkpoint of the state ``meta_path``, refused (InvalidInput) if it
        lies past the shards, or outside this reader's part where that shows without opening
        a shard."""
        self.shards = shards
        self.end = len(shards)  # ``first``/``after`` give it when no shard is left
        self.plan = plan
        self.resume = resume
        self._meta_path = meta_path
        self._pieces = shard_pieces(plan.intervals, len(shards)) if plan.partition else None
        self._own_shards = sorted(self._pieces) if self._pieces is not None else []
        if resume.shard_id > len(self.shards):
            raise InvalidInput(
                f"{self._meta_path}: checkpoint is at shard {resume.shard_id} but the "
                f"sources expand to {len(self.shards)} shards (different sources?)"
            )
        # a line checkpoint past the end of one of this reader's ranges: its last line is
        # checked when its shard is opened (``open``)
        self._past_end = False
        if (
            self._pieces is not None
            and resume != StreamCoordinate()
            and resume.shard_id < len(self.shards)
        ):
            pieces = self._pieces.get(resume.shard_id)
            if pieces is None:
                raise InvalidInput(
                    f"{self._meta_path}: checkpoint is at shard {resume.shard_id}, which "
                    f"holds no records of reader rank {plan.rank}, worker {plan.worker} "
                    "(a state of another reader or partition?)"
                )
            if self.shards[resume.shard_id].format == "lines":  # Parquet: when opened
                key = (resume.byte_offset, 0)
                if not resumes_in(pieces, key):
                    self._past_end = any(b is not None and b < key for _, b in pieces)
                    if not self._past_end:
                        raise self._not_mine(resume)

    def first(self) -> int:
        """The shard read first: the checkpoint's, or the next that holds this reader's records
        (``len(shards)``: none is left)."""
        return self._next_shard(self.resume.shard_id)

    def after(self, shard_id: int) -> int:
        """The shard read after ``shard_id`` (``len(shards)``: none is left)."""
        return self._next_shard(shard_id + 1)

    def _next_shard(self, shard_id: int) -> int:
        """The first shard at or after ``shard_id`` that holds records of this reader."""
        if self._pieces is None:
            return shard_id
        i = bisect_left(self._own_shards, shard_id)
        return self._own_shards[i] if i < len(self._own_shards) else len(self.shards)

    def open(
        self, shard_id: int, global_start: int
    ) -> LineShardReader | ParquetShardReader | None:
        """A reader of shard ``shard_id`` from where this stream resumes in it, its first
        record numbered ``global_start`` (None: nothing of this shard is left for this reader,
        known without opening it). A partitioned reader's checkpoint is checked here against
        what opening learns (``resumes_in``)."""
        shard = self.shards[shard_id]
        resume = self.resume if shard_id == self.resume.shard_id else None
        if self._pieces is None:
            if shard.format == "lines":
                return LineShardReader(
                    shard, shard_id, resume.byte_offset if resume else 0, global_start
                )
            return ParquetShardReader(
                shard,
                shard_id,
                resume.row_group_idx if resume else 0,
                resume.row_offset_in_page if resume else 0,
                global_start,
            )
        assert self.plan.partition is not None
        pieces = self._pieces[shard_id]
        size = self.plan.partition.shard_sizes[shard_id]
        past_end = resume is not None and self._past_end
        reader: LineShardReader | ParquetShardReader
        if shard.format == "lines":
            ranges = line_ranges(pieces, resume.byte_offset if resume else None)
            if not ranges and not past_end:
                return None
            reader = LineShardReader(
                shard, shard_id, 0, global_start, ranges=ranges, expected_size=size
            )
        else:
            reader = ParquetShardReader(
                shard,
                shard_id,
                resume.row_group_idx if resume else 0,
                resume.row_offset_in_page if resume else 0,
                global_start,
                pieces=pieces,
                expected_size=size,
            )
        try:
            if past_end:  # only the line that crosses a range's end may lead past it
                assert resume is not None and isinstance(reader, LineShardReader)
                start = reader.line_start(resume.byte_offset)
                if start is None or not owns(pieces, (start, 0)):
                    raise self._not_mine(resume)
            elif isinstance(reader, ParquetShardReader) and resume is not None:
                key = reader.resume_key()  # None: at the start, or refused when read
                if key is not None and not resumes_in(pieces, key):
                    raise self._not_mine(resume)
        except BaseException:
            reader.close()
            raise
        return reader

    def _not_mine(self, coord: StreamCoordinate) -> InvalidInput:
        """The refusal of a checkpoint that cannot be one of this reader's commits."""
        if self.shards[coord.shard_id].format == "lines":
            where = f"byte {coord.byte_offset}"
        else:
            where = f"row {coord.row_offset_in_page} of row group {coord.row_group_idx}"
        return InvalidInput(
            f"{self._meta_path}: checkpoint is at {where} of shard {coord.shard_id}, "
            f"outside the records of reader rank {self.plan.rank}, worker {self.plan.worker} "
            "(a state of another reader or partition?)"
        )
