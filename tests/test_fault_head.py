"""A reader of a blob that is still landing from a streaming source is answered as soon as
its bytes are in, not when the whole blob is (``Flight.show``, ``Faulter.fault_range``).

The source here streams its bytes in steps and then holds the rest on a gate until the test
opens it: a reader served only once the blob is whole would wait for the gate, so the early
answer is proven by the read returning while the gate is shut. The bytes served early are the
source's; a reader of bytes that never land gets EIO, never zeros; the blob is still staged
whole and single-flight holds (one source read). A reader far into a blob splits its fault
in two reads at once, its own part first: it is answered from the first bytes of its part
while the blob's head is still held at the gate."""

from __future__ import annotations

import contextlib
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
BIG = 1024 * KiB
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
        self.starts: list[int] = []  # where each read began

    def version(self) -> SourceVersion:
        return SourceVersion(len(self.data), "v1")

    def mtime(self) -> float:
        return 1_700_000_000.0

    def pread(self, off: int, size: int) -> bytes:
        raise AssertionError("a streaming fault reads with pread_stream")

    def pread_stream(self, off, size, landed, piece, *, into=None):
        self.reads += 1
        self.starts.append(off)
        end = min(off + size, len(self.data))
        view = memoryview(bytearray(end - off)) if into is None else into[:end - off]
        buf = view
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


@contextlib.contextmanager
def _streaming(monkeypatch, tmp_path, cs):
    data = payload(3 * cs + 5000)
    source = GatedStreamingSource(data, head=4 * STEP)

    def open_source(url, options=None):
        assert url == URL
        return source

    monkeypatch.setattr(assimilators.binary, "open_source", open_source)
    engine = engine_for(BlobStore(str(tmp_path / "store")), memory_mb=0, prefetch_mb=0)
    tag = engine.register(FaultContext(URL, "obj", format="binary", chunk_size=cs))
    try:
        yield engine, tag, source, data
    finally:
        source.gate.set()
        engine.close()


@pytest.fixture
def streaming(monkeypatch, tmp_path):
    with _streaming(monkeypatch, tmp_path, CS) as made:
        yield made


@pytest.fixture
def big_blobs(monkeypatch, tmp_path):
    """The gated source under 1 MiB blobs: a reader far into one splits its fault."""
    with _streaming(monkeypatch, tmp_path, BIG) as made:
        yield made


def early_then_late(engine, source, tag, index, early, late):
    """Read 4 KiB at ``early`` of blob ``index`` while the source holds what lies past its
    pieces' first bytes at the gate (answered before the gate opens), then at ``late``
    (answered only once the gate is open); both byte strings, once the blob is stored."""
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            late_done = trio.Event()

            async def late_reader():  # bytes past the gate: only once they are in
                out["late"] = bytes(await engine.read_blob(tag, index, late, 4 * KiB))
                late_done.set()

            with trio.fail_after(10):
                got = await engine.read_blob(tag, index, early, 4 * KiB)
                assert not source.gate.is_set(), "answered while the rest waits at the gate"
                out["early"] = bytes(got)
                nursery.start_soon(late_reader)
                await trio.sleep(0.05)
                assert "late" not in out, "bytes that had not landed were served"
                source.gate.set()
                await late_done.wait()
                while engine.pending_stores:  # noqa: ASYNC110 - a store write, no event
                    await trio.sleep(0.01)

    trio.run(main)
    return out["early"], out["late"]


def test_a_reader_of_the_blobs_head_is_answered_before_the_blob_lands(streaming):
    engine, tag, source, data = streaming
    early, late = early_then_late(engine, source, tag, 1, 1000, CS - 4 * KiB)
    out = {"early": early, "late": late}
    assert out["early"] == data[CS + 1000:CS + 1000 + 4 * KiB]
    assert out["late"] == data[2 * CS - 4 * KiB:2 * CS]
    assert source.reads == 1, "the early and the late reader shared one source read"
    c = engine.stats.counters
    assert c["single_flight_joins"] == 1 and c["faults"] == 1 and c["head_reads"] == 1
    assert engine.tiers.local.contains((tag.id, 1)), "the whole blob was staged"
    whole = trio.run(engine.read_blob, tag, 1, 0, CS)
    assert bytes(whole) == data[CS:2 * CS] and source.reads == 1


def landed_then_eio(engine, tag, index, landed, failing, between=lambda: None):
    """Read ``landed = (off, size)`` of blob ``index`` from a source that fails after its
    pieces' first bytes (served: they landed), call ``between()``, then each of ``failing``
    (EIO, never zeros); the bytes served."""
    out = {}

    async def main():
        async with trio.open_nursery() as nursery:
            engine.attach(nursery)
            with trio.fail_after(10):
                out["landed"] = bytes(await engine.read_blob(tag, index, *landed))
                between()
                for off, size in failing:
                    with pytest.raises(FaultfsError) as err:
                        await engine.read_blob(tag, index, off, size)
                    assert err.value.errno == 5

    trio.run(main)
    return out["landed"]


def test_a_failed_stream_serves_what_landed_and_eio_for_the_rest(streaming):
    engine, tag, source, data = streaming
    source.fail_after_head = True
    early = landed_then_eio(engine, tag, 0, (0, 2 * STEP), [(CS - 100, 100)])
    assert early == data[:2 * STEP]
    assert not engine.tiers.local.contains((tag.id, 0)), "a failed fault stores nothing"


def test_without_a_mount_the_reader_gets_the_whole_blob(streaming):
    engine, tag, source, data = streaming
    source.gate.set()
    got = trio.run(engine.read_blob, tag, 2, 10, 100)
    assert bytes(got) == data[2 * CS + 10:2 * CS + 110]
    assert engine.tiers.local.contains((tag.id, 2))


def test_a_reader_far_into_a_blob_is_answered_from_its_own_part_of_a_split_fault(big_blobs):
    engine, tag, source, data = big_blobs
    at = 700 * KiB  # the part from 640 KiB is read beside the head [0, 640 KiB)
    mine, head = early_then_late(engine, source, tag, 1, at, 400 * KiB)
    out = {"mine": mine, "head": head}
    assert out["mine"] == data[BIG + at:BIG + at + 4 * KiB]
    assert out["head"] == data[BIG + 400 * KiB:BIG + 404 * KiB]
    assert sorted(source.starts) == [BIG, BIG + 640 * KiB], "two reads, one blob's bytes"
    c = engine.stats.counters
    assert c["split_faults"] == 1 and c["faults"] == 1 and c["head_reads"] >= 1
    whole = trio.run(engine.read_blob, tag, 1, 0, BIG)
    assert bytes(whole) == data[BIG:2 * BIG], "the blob staged whole from its two parts"
    assert source.reads == 2


def test_a_split_fault_that_fails_serves_what_landed_and_eio_never_zeros(big_blobs):
    engine, tag, source, data = big_blobs
    source.fail_after_head = True

    def fail_at_once():
        source.head = 0  # from now on every read fails at once

    # its part's first 64 KiB land, then both parts fail: served; then split faults whose
    # reader's part fails
    mine = landed_then_eio(engine, tag, 2, (900 * KiB, 4 * KiB),
                           [(300 * KiB, 4096), (BIG - 5000, 4096)], fail_at_once)
    assert mine == data[2 * BIG + 900 * KiB:2 * BIG + 904 * KiB]
    assert engine.stats.counters["split_faults"] >= 2
    assert not engine.tiers.local.contains((tag.id, 2)), "a failed fault stores nothing"
