"""A reader of a blob that is still landing from a streaming source is answered as soon as
its bytes are in, not when the whole blob is (``Flight.show``, ``Faulter.fault_range``).

The source here streams its bytes in steps and then holds the rest on a gate until the test
opens it: a reader served only once the blob is whole would wait for the gate, so the early
answer is proven by the read returning while the gate is shut. The bytes served early are the
source's; a reader of bytes that never land gets EIO, never zeros; the blob is still staged
whole and single-flight holds (one source read)."""

from __future__ import annotations

import threading

import pytest
import trio

import assimilators.binary
from faultfs.core.context import FaultContext
from faultfs.errors import FaultfsError, SourceError
from faultfs.sources import SourceVersion
from faultfs.store.blobstore import BlobStore
from faultfs.testing.fakes import engine_for, payload

KiB = 1 << 10
CS = 256 * KiB
STEP = 16 * KiB
URL = "stream://test/object.bin"


class GatedStreamingSource:
    """Streams ``data`` in ``STEP`` pieces; after ``head`` bytes of a read it waits for
    ``gate`` (or fails, with ``fail_after_head``)."""

    def __init__(self, data: bytes, head: int) -> None:
        self.url = URL
        self.data = data
        self.head = head
        self.gate = threading.Event()
        self.at_gate = threading.Event()
        self.fail_after_head = False
        self.reads = 0

    def version(self) -> SourceVersion:
        return SourceVersion(len(self.data), "v1")

    def mtime(self) -> float:
        return 1_700_000_000.0

    def pread(self, off: int, size: int) -> bytes:
        raise AssertionError("a streaming fault reads with pread_stream")

    def pread_stream(self, off, size, landed, piece):
        self.reads += 1
        end = min(off + size, len(self.data))
        buf = bytearray(end - off)
        view = memoryview(buf)
        pos = 0
        while pos < len(buf):
            if pos >= self.head and not self.gate.is_set():
                self.at_gate.set()
                if self.fail_after_head:
                    raise SourceError(f"{URL}: the connection was reset")
                assert self.gate.wait(20), "the test never opened the gate"
            n = min(STEP, len(buf) - pos)
            buf[pos:pos + n] = self.data[off + pos:off + pos + n]
            pos += n
            landed(view[:pos])
        return view

    def close(self) -> None:
        pass


@pytest.fixture
def streaming(monkeypatch, tmp_path):
    data = payload(3 * CS + 5000)
    source = GatedStreamingSource(data, head=4 * STEP)

    def open_source(url, options=None):
        assert url == URL
        return source

    monkeypatch.setattr(assimilators.binary, "open_source", open_source)
    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=0, prefetch_mb=0)
    tag = engine.register(FaultContext(URL, "obj", format="binary", chunk_size=CS))
    yield engine, tag, source, data
    source.gate.set()
    engine.close()


def test_a_reader_of_the_blobs_head_is_answered_before_the_blob_lands(streaming):
    engine, tag, source, data = streaming
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)

            late_done = trio.Event()

            async def late_reader():  # the blob's end: only once all of it is in
                out["late"] = bytes(await engine.read_blob(tag, 1, CS - 4 * KiB, 4 * KiB))
                late_done.set()

            with trio.fail_after(10):
                early = await engine.read_blob(tag, 1, 1000, 4 * KiB)
                assert not source.gate.is_set()
                out["early"] = bytes(early)
                nursery.start_soon(late_reader)
                await trio.sleep(0.05)
                assert "late" not in out, "bytes past the head were served before they landed"
                source.gate.set()
                await late_done.wait()
                while engine.pending_stores:  # noqa: ASYNC110 - a store write, no event
                    await trio.sleep(0.01)

    trio.run(main)
    assert out["early"] == data[CS + 1000:CS + 1000 + 4 * KiB]
    assert out["late"] == data[2 * CS - 4 * KiB:2 * CS]
    assert source.reads == 1, "the early and the late reader shared one source read"
    c = engine.stats.counters
    assert c["single_flight_joins"] == 1 and c["faults"] == 1 and c["head_reads"] == 1
    assert engine.tiers.local.contains((tag.id, 1)), "the whole blob was staged"
    whole = trio.run(engine.read_blob, tag, 1, 0, CS)
    assert bytes(whole) == data[CS:2 * CS] and source.reads == 1


def test_a_failed_stream_serves_what_landed_and_eio_for_the_rest(streaming):
    engine, tag, source, data = streaming
    source.fail_after_head = True
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            with trio.fail_after(10):
                out["early"] = bytes(await engine.read_blob(tag, 0, 0, 2 * STEP))
                with pytest.raises(FaultfsError) as err:
                    await engine.read_blob(tag, 0, CS - 100, 100)
                out["errno"] = err.value.errno

    trio.run(main)
    assert out["early"] == data[:2 * STEP]
    assert out["errno"] == 5
    assert not engine.tiers.local.contains((tag.id, 0)), "a failed fault stores nothing"


def test_without_a_mount_the_reader_gets_the_whole_blob(streaming):
    engine, tag, source, data = streaming
    source.gate.set()
    got = trio.run(engine.read_blob, tag, 2, 10, 100)
    assert bytes(got) == data[2 * CS + 10:2 * CS + 110]
    assert engine.tiers.local.contains((tag.id, 2))
