"""The source side of a fault: which tags' runs are handed on blob by blob as they land,
what a run holds of the data budget meanwhile, and the source reads themselves (blocking, on
a pool thread), their failures logged once and raised as ``FaultfsError``, and counted.

A run of a streaming source (``streams``: the S3 and other remote sources, a layout of equal
chunks of adjacent source bytes) is handed on blob by blob as each lands; from a source that
receives as the bytes arrive (``in_pieces``: S3) each blob lands in a buffer of its own
(``buffers.Pieces``), so the run holds one blob of memory while it is under way (``holds``),
and a blob dropped from memory frees just itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from assimilators.binary import BinaryFileAssimilator
from faultfs.buffers import Pieces
from faultfs.core.chunks import ChunkLayout, zero_fill
from faultfs.engine.tags import Tag
from faultfs.errors import FaultfsError, SourceChanged, SourceError
from faultfs.stats import Stats
from faultfs.tiers.base import Buffer

log = logging.getLogger("faultfs.engine")

T = TypeVar("T")


class SourceReads:
    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self._told_unavailable: set[int] = set()  # tags whose unreachable source was logged

    def holds(self, tag: Tag, count: int) -> int:
        """Bytes of the data budget a run of ``count`` blobs of ``tag`` holds while its
        source read is under way (``fault_run``): one blob from a streaming source, else
        the whole run."""
        return tag.layout.chunk_size * (1 if self.in_pieces(tag) else count)

    @classmethod
    def in_pieces(cls, tag: Tag) -> bool:
        """Whether a run of ``tag`` lands blob by blob, each into a buffer of its own
        (``stream_source`` into ``Pieces``), holding one blob of memory while it lands."""
        return cls.streams(tag) and bool(getattr(tag.source, "receives_in_pieces", False))

    @staticmethod
    def streams(tag: Tag) -> bool:
        """Whether the blobs of ``tag`` can be handed on as each lands: a source that reads
        by pieces, and a layout of equal chunks of adjacent source bytes (the binary
        assimilator's own: its ``read_blobs`` is what ``stream_source`` does, piece by piece)."""
        return (type(tag.assimilator) is BinaryFileAssimilator
                and isinstance(tag.layout, ChunkLayout)
                and callable(getattr(tag.source, "pread_stream", None)))

    def stream_source(self, tag: Tag, first: int, count: int,
                      landed: Callable[[int, Buffer], None],
                      partly: Callable[[int, memoryview], None] | None = None,
                      wanted: Callable[[int], int] | None = None,
                      pause: Callable[[], None] | None = None) -> Sequence[Buffer]:
        """As ``read_source``, calling ``landed(i, blob)`` (on this pool thread) as soon as
        blob ``first + i`` is wholly in, while the rest of the run is still being read; and
        ``partly(i, head)`` with the source bytes of blob ``first + i`` in so far, when a
        reader waits for no more than those (``wanted(i)``: the least end it waits for);
        ``pause()`` after each blob but the last landed, before the next is received."""
        layout = tag.layout
        cs = layout.chunk_size
        start = layout.source_range(first)[0]
        end = layout.source_range(first + count - 1)[1]
        blobs: list[Buffer] = []
        shown = 0  # bytes of blob first + len(blobs) told to partly

        def progress(data: memoryview) -> None:
            """``data``: the run's first bytes, as far as they are in."""
            nonlocal shown
            n = len(data)
            while len(blobs) < count:
                i = len(blobs)
                stop = min((i + 1) * cs, end - start)
                if stop > n:
                    if partly is not None and wanted is not None:
                        have = n - i * cs
                        if have > shown and have >= wanted(i):
                            shown = have
                            partly(i, data[i * cs:n])
                    return
                blob = zero_fill(data[i * cs:stop], cs)
                blobs.append(blob)
                shown = 0
                landed(i, blob)
                if pause is not None and i + 1 < count and n == stop:
                    pause()  # (the next blob's bytes are not in yet)

        def read() -> memoryview | Pieces:
            assert tag.source is not None  # each blob into a buffer of its own (``hand``)
            return tag.source.pread_stream(start, end - start, progress, cs,
                                           into=Pieces(end - start, cs))

        raw = self.guarded(tag, first, start, end, read)
        if len(raw) != end - start:
            raise SourceError(f"source {tag.ctx.src} ended early: [{start}, {end}) gave "
                              f"{len(raw)} bytes")
        progress(raw)  # whatever the source did not tell
        return blobs

    def read_source(self, tag: Tag, first: int, count: int = 1) -> Sequence[Buffer]:
        """Blobs ``first .. first+count-1`` from the source, each zero-filled to the blob size
        (blocking: on the pool)."""
        layout = tag.layout
        start = layout.source_range(first)[0]
        end = layout.source_range(first + count - 1)[1]

        def read() -> Sequence[Buffer]:
            assert tag.source is not None
            return tag.assimilator.read_blobs(tag.source, tag.ctx, layout, first, count)

        blobs = self.guarded(tag, first, start, end, read)
        if len(blobs) != count or any(len(b) != layout.chunk_size for b in blobs):
            raise SourceError(f"assimilator {tag.ctx.format!r} returned blobs of the wrong size "
                              f"for {tag.ctx.src} [{start}, {end})")
        return blobs

    def guarded(self, tag: Tag, first: int, start: int, end: int,
                      read: Callable[[], T]) -> T:
        """``read()`` of source bytes ``[start, end)`` (from blob ``first``) of ``tag``, its
        failures logged (a
        changed source once per tag) and raised as ``FaultfsError``."""
        if tag.source is None:
            if tag.id not in self._told_unavailable:
                self._told_unavailable.add(tag.id)  # once per tag: not a line per read
                log.error("tag %s: blob %s is not staged here or in a shared store, and the "
                          "source is unreachable from this node (%s): reads of it fail (EIO)",
                          tag.name, tag.layout.blob_name(first), tag.source_error)
            raise SourceError(f"source {tag.ctx.src} of tag {tag.name} is unavailable: "
                              f"{tag.source_error}")
        try:
            return read()
        except SourceChanged as exc:
            if not tag.changed_under_mount:
                log.warning("tag %s: %s; its unstaged blobs fail until a remount re-faults "
                            "them from the new version", tag.name, exc)
            tag.changed_under_mount = exc.message
            raise
        except FaultfsError as exc:
            log.error("tag %s: reading %s [%d, %d) failed: %s", tag.name, tag.ctx.src, start,
                      end, exc)
            raise
        except OSError as exc:
            log.error("tag %s: reading %s [%d, %d) failed: %s", tag.name, tag.ctx.src, start,
                      end, exc)
            raise SourceError(f"reading {tag.ctx.src} [{start}, {end}) failed: {exc}") from None

    def count(self, tag: Tag, first: int, count: int) -> None:
        """A source read of blobs ``first .. first+count-1`` of ``tag`` is done."""
        start = tag.layout.source_range(first)[0]
        end = tag.layout.source_range(first + count - 1)[1]
        self.stats.add("source_reads")
        self.stats.add("source_bytes", end - start)
        self.stats.add("zero_filled_bytes", count * tag.layout.chunk_size - (end - start))
