"""The assimilator protocol: how a source format is cut into blobs (a layout) and read a run at a time.

An assimilator is stateless; per-registration state lives in the ``Source`` it opens and the
``BlobLayout`` it returns. ``blob_bytes(ctx) == 0`` means it cannot ingest per blob, and an
on-fault registration against it fails with result code -20.

Invariants a plugin keeps:
- ``layout(ctx, version)`` is pure arithmetic over the context and the source's size; it
  raises ``InvalidInput`` for a context the source cannot satisfy (a range past its end).
- ``read_blobs(source, ctx, layout, first, count)`` returns ``count`` payloads of exactly
  ``layout.chunk_size`` bytes each (a short tail zero-filled) for blobs ``first ..
  first+count-1``, with as few source requests as it can (the engine only asks for runs the
  layout's ``coalesce`` allowed); a source that returns fewer bytes than the layout promised
  is a ``SourceError``, never zeros.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from faultfs.core.context import FaultContext
from faultfs.sources import Source, SourceOptions, SourceVersion

Buffer = bytes | memoryview


class BlobLayout(Protocol):
    """Where each blob of a tag comes from, and how the whole-object view is cut into blobs."""

    chunk_size: int  # bytes of every blob (a short source tail is zero-filled to it)
    blob_prefix: str

    @property
    def size(self) -> int:
        """Bytes of the whole-object view."""
        ...

    @property
    def num_blobs(self) -> int: ...

    def blob_name(self, index: int) -> str: ...

    def blob_index(self, name: str) -> int | None: ...

    def source_range(self, index: int) -> tuple[int, int]:
        """Source bytes ``[start, end)`` blob ``index`` holds."""
        ...

    def view_pieces(self, off: int, size: int) -> list[tuple[int, int, int]]:
        """``(blob_index, offset_in_blob, length)`` pieces of view bytes ``[off, off+size)``."""
        ...

    def coalesce(self, first: int, count: int) -> int:
        """How many of blobs ``first .. first+count-1`` one source read can fetch together."""
        ...


class Assimilator(Protocol):
    name: str
    default_chunk_size: int

    def blob_bytes(self, ctx: FaultContext) -> int:
        """Bytes per blob for ``ctx`` (0: cannot ingest per blob)."""
        ...

    def open(self, ctx: FaultContext, options: SourceOptions) -> Source:
        """Open the context's source (blocking)."""
        ...

    def layout(self, ctx: FaultContext, version: SourceVersion) -> BlobLayout:
        """The blobs of ``ctx`` over a source at ``version``; InvalidInput if it cannot be."""
        ...

    def read_blobs(self, source: Source, ctx: FaultContext, layout: BlobLayout, first: int,
                   count: int) -> Sequence[Buffer]:
        """Whole payloads of blobs ``first .. first+count-1`` (blocking)."""
        ...
