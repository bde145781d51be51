"""The assimilator protocol: how a source format is cut into blobs and read one blob at a time.

An assimilator is stateless; per-registration state lives in the ``Source`` it opens.
``blob_bytes(ctx) == 0`` means it cannot ingest per blob, and an on-fault registration against
it fails with result code -20.
"""

from __future__ import annotations

from typing import Protocol

from faultfs.assimilators.sources import Source, SourceOptions
from faultfs.core.context import FaultContext


class Assimilator(Protocol):
    name: str
    default_chunk_size: int

    def blob_bytes(self, ctx: FaultContext) -> int:
        """Bytes per blob for ``ctx`` (0: cannot ingest per blob)."""
        ...

    def open(self, ctx: FaultContext, options: SourceOptions) -> Source:
        """Open the context's source (blocking)."""
        ...

    def read_blob(self, source: Source, ctx: FaultContext, start: int, end: int) -> bytes:
        """Source bytes ``[start, end)`` of one blob, exactly (blocking)."""
        ...
