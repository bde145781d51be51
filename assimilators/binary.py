"""The binary-file assimilator: any byte source cut into equal chunks of a byte range, read by range.

Blob ``i`` holds source bytes ``[r0 + i*cs, min(r0 + (i+1)*cs, r1))`` (DESIGN §4); a short
final blob is zero-filled to ``cs``. Adjacent chunks are adjacent source bytes, so a run of
them costs one source read.
"""

from __future__ import annotations

from faultfs.core.chunks import ChunkLayout, zero_fill
from faultfs.core.context import FaultContext
from faultfs.errors import InvalidInput, SourceError
from faultfs.sources import Source, SourceOptions, SourceVersion, open_source

DEFAULT_CHUNK_SIZE = 1 << 20  # upstream's default for files: 1 MiB per blob

Buffer = bytes | memoryview


class BinaryFileAssimilator:
    name = "binary"
    default_chunk_size = DEFAULT_CHUNK_SIZE

    def blob_bytes(self, ctx: FaultContext) -> int:
        return ctx.chunk_size or self.default_chunk_size

    def open(self, ctx: FaultContext, options: SourceOptions) -> Source:
        return open_source(ctx.src, options)

    def layout(self, ctx: FaultContext, version: SourceVersion) -> ChunkLayout:
        size = version.size
        if ctx.range_off > size:
            raise InvalidInput(
                f"range offset {ctx.range_off} is past the end of {ctx.src} ({size} bytes)")
        end = size if ctx.range_size == 0 else ctx.range_off + ctx.range_size
        if end > size:
            raise InvalidInput(
                f"range {ctx.range_off}:{ctx.range_size} is past the end of {ctx.src} "
                f"({size} bytes)")
        return ChunkLayout(ctx.range_off, end, self.blob_bytes(ctx), ctx.blob_prefix)

    def read_blobs(self, source: Source, ctx: FaultContext, layout: ChunkLayout, first: int,
                   count: int) -> list[Buffer]:
        start = layout.source_range(first)[0]
        end = layout.source_range(first + count - 1)[1]
        raw = source.pread(start, end - start)
        if len(raw) != end - start:
            raise SourceError(
                f"source {ctx.src} ended early: [{start}, {end}) gave {len(raw)} bytes")
        cs = layout.chunk_size
        if count == 1:
            return [zero_fill(raw, cs)]
        view = memoryview(raw)  # the blobs of a run are slices of its one buffer
        return [zero_fill(view[i * cs:(i + 1) * cs], cs) for i in range(count)]
