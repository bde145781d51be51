"""In-memory sources and the assimilator over them: failure is a fixture, not a mock.

``MemorySource`` holds its bytes in memory, counts reads, fails chosen calls (an injected
``SourceError``, counted in ``failures``), fails every read as changed (``changed``) and can hold every read on a gate (to race readers).
``MemoryAssimilator`` (format ``memtest``) cuts any registered ``MemorySource`` like the binary
assimilator. ``engine_for`` and ``ctx_for`` build an engine and a context over them.
"""

from __future__ import annotations

import threading
import time

import assimilators
from assimilators.binary import BinaryFileAssimilator
from faultfs.config import Config
from faultfs.core.context import FaultContext
from faultfs.engine import Engine
from faultfs.errors import InvalidInput, SourceChanged, SourceError
from faultfs.sources import SourceVersion
from faultfs.store.blobstore import BlobStore

CS = 4096  # a small chunk: a few KiB exercise every path of the engine
MEMTEST = "memtest"


class MemorySource:
    """A source held in memory; counts reads; can fail on chosen calls or block on a gate."""

    def __init__(self, data: bytes, url: str = "mem://x", *, size: int | None = None) -> None:
        self.url = url
        self.data = data
        self.size = size  # claimed size (a huge layout without the bytes); None: len(data)
        self.reads = 0
        self.ranges: list[tuple[int, int]] = []  # (off, size) of every read, in order
        self.failures = 0  # injected failures raised so far
        self.fail_calls: set[int] = set()
        self.gate: threading.Event | None = None
        self.delay_s = 0.0  # each read takes at least this long (a slow source)
        self.token = "v1"
        self.changed = ""  # set: every read fails as a source changed under the mount would
        self._lock = threading.Lock()

    def version(self) -> SourceVersion:
        return SourceVersion(len(self.data) if self.size is None else self.size, self.token)

    def mtime(self) -> float:
        return 1_700_000_000.0

    def pread(self, off: int, size: int) -> bytes:
        with self._lock:
            self.reads += 1
            self.ranges.append((off, size))
            call = self.reads
            failing = call in self.fail_calls
            if failing:
                self.failures += 1
        if self.gate is not None:
            self.gate.wait(10)
        if self.delay_s:
            time.sleep(self.delay_s)
        if failing:
            raise SourceError(f"{self.url}: injected failure on call {call}")
        if self.changed:
            raise SourceChanged(f"{self.url} changed under the mount ({self.changed})")
        return self.data[off:off + size]

    def close(self) -> None:
        pass


class MemoryAssimilator(BinaryFileAssimilator):
    """The binary assimilator's cut over ``MemorySource`` objects registered by URL."""

    name = MEMTEST
    default_chunk_size = CS
    sources: dict[str, MemorySource] = {}

    def open(self, ctx, options):
        try:
            return self.sources[ctx.src]
        except KeyError:
            raise InvalidInput(f"source {ctx.src} does not exist") from None


class NoBlobAssimilator(MemoryAssimilator):
    """An assimilator that cannot ingest per blob (``blob_bytes`` 0: result code -20)."""

    name = "noblob"

    def blob_bytes(self, ctx):
        return 0


assimilators.register(MEMTEST, MemoryAssimilator())
assimilators.register("noblob", NoBlobAssimilator())


def make_source(data: bytes, url: str = "mem://x", *, size: int | None = None) -> MemorySource:
    src = MemorySource(data, url, size=size)
    MemoryAssimilator.sources[url] = src
    return src


def engine_for(store: BlobStore, *, writes_ops=None, **config) -> Engine:
    config.setdefault("reserve_mb", 0)
    return Engine(store, Config(store_dir=store.root, **config), writes_ops=writes_ops)


def ctx_for(url: str = "mem://x", tag: str = "t", **kw) -> FaultContext:
    return FaultContext(src=url, dst=tag, format=MEMTEST, chunk_size=kw.pop("chunk_size", CS), **kw)


def payload(n: int) -> bytes:
    """``n`` bytes with no run of equal bytes, so a wrong offset is always visible."""
    return bytes((i * 7 + i // 251) & 0xFF for i in range(n))
