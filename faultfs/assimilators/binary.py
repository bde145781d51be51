"""The binary-file assimilator: any byte source cut into equal chunks, read by range."""

from __future__ import annotations

from faultfs.assimilators.sources import Source, SourceOptions, open_source
from faultfs.core.context import FaultContext
from faultfs.errors import SourceError

DEFAULT_CHUNK_SIZE = 1 << 20  # upstream's default for files: 1 MiB per blob


class BinaryFileAssimilator:
    name = "binary"
    default_chunk_size = DEFAULT_CHUNK_SIZE

    def blob_bytes(self, ctx: FaultContext) -> int:
        return ctx.chunk_size or DEFAULT_CHUNK_SIZE

    def open(self, ctx: FaultContext, options: SourceOptions) -> Source:
        return open_source(ctx.src, options)

    def read_blob(self, source: Source, ctx: FaultContext, start: int, end: int
                  ) -> bytes | memoryview:
        data = source.pread(start, end - start)
        if len(data) != end - start:
            raise SourceError(
                f"source {ctx.src} ended early: [{start}, {end}) gave {len(data)} bytes"
            )
        return data
