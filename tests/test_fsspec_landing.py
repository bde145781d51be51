"""``faultfs/fsspec/landing.py`` without a store or a network: a reader is answered from the
part of a chunk its bytes are in while the rest is held back, a part that fails fails only
the readers whose bytes did not land, and a split read hands its buffer back only once both
parts ended. The source is a streaming fake whose parts can be held or failed at a byte."""

from __future__ import annotations

import random
import threading
import time

import pytest

from faultfs.errors import SourceError
from faultfs.fsspec.landing import PIECE, Landing, SplitLane, read_chunk, split_at

KiB, MiB = 1 << 10, 1 << 20
WAIT_S = 10  # no step here takes near this long: a longer wait is a hang


class StreamingSource:
    """``pread_stream`` as the remote sources have it: bytes into ``into`` piece by piece,
    ``landed(bytes in so far)`` after each; a read starting at ``hold_at`` waits for
    ``gate`` first, one reaching ``fail_at`` raises there."""

    url = "mem://streaming"

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.gate = threading.Event()
        self.hold_at: int | None = None
        self.fail_at: int | None = None
        self.ended: list[int] = []  # where each read started, as it ended

    def pread(self, off: int, size: int) -> bytes:
        return self.data[off:off + size]

    def pread_stream(self, off, size, landed, piece, *, into):
        try:
            if off == self.hold_at:
                assert self.gate.wait(WAIT_S)
            pos = 0
            while pos < size:
                stop = min(size, pos + piece)
                if self.fail_at is not None and off + pos <= self.fail_at < off + stop:
                    raise SourceError(f"{self.url}: injected failure at {self.fail_at}")
                into[pos:stop] = self.data[off + pos:off + stop]
                pos = stop
                landed(into[:pos])
            return into[:size]
        finally:
            self.ended.append(off)


def reader(landing: Landing, off: int, size: int, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            out[off] = bytes(landing.range(off, off + size)[0])
        except Exception as exc:
            out[off] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_reader_far_into_a_chunk_is_answered_from_its_own_part():
    data = random.Random(1).randbytes(MiB)
    src = StreamingSource(data)
    at = split_at(700 * KiB + 123, MiB)
    assert at == 640 * KiB  # aligned down to 64 KiB
    assert split_at(200 * KiB, MiB) == 0, "too near the start: one read"
    src.hold_at = 0  # the head part waits: only the reader's part lands
    landing, out = Landing(), {}
    done: dict = {}
    chunk = threading.Thread(target=lambda: done.update(
        got=read_chunk(src, 0, MiB, landing.show, at=at, lane=SplitLane())))
    chunk.start()
    thread = reader(landing, 700 * KiB + 123, 4096, out)
    thread.join(WAIT_S)
    assert out[700 * KiB + 123] == data[700 * KiB + 123:700 * KiB + 123 + 4096]
    assert "got" not in done, "the chunk is not whole: the head is held"
    head = reader(landing, 10, 100, out)  # a reader of the held part waits for it
    time.sleep(0.05)
    assert 10 not in out
    src.gate.set()
    chunk.join(WAIT_S)
    head.join(WAIT_S)
    got, split = done["got"]
    assert split and bytes(got) == data and out[10] == data[10:110]
    landing.finish(got)
    assert bytes(landing.range(0, MiB)[0]) == data


def test_a_failed_part_fails_only_readers_whose_bytes_did_not_land():
    data = random.Random(2).randbytes(MiB)
    src = StreamingSource(data)
    at = split_at(768 * KiB, MiB)
    src.fail_at = 300 * KiB  # in the head part, after its first pieces landed
    landing = Landing()
    with pytest.raises(SourceError, match="injected"):
        read_chunk(src, 0, MiB, landing.show, at=at, lane=SplitLane())
    assert sorted(src.ended) == [0, at], "the buffer came back only after both parts ended"
    landing.fail(SourceError("the fault failed"))
    assert bytes(landing.range(at + 5, at + 4101)[0]) == data[at + 5:at + 4101]
    assert bytes(landing.range(0, PIECE)[0]) == data[:PIECE], "landed before the failure"
    with pytest.raises(SourceError, match="the fault failed"):
        landing.range(300 * KiB, 300 * KiB + 1)  # never landed: the error, not zeros


def test_a_landing_wakes_its_readers_once_with_bytes_or_an_error():
    landing, out = Landing(), {}
    threads = [reader(landing, off, 10, out) for off in (0, 55, 90)]
    landing.show(0, memoryview(b"a" * 60))
    threads[0].join(WAIT_S)
    threads[1].join(0.05)
    assert out[0] == b"a" * 10 and 55 not in out  # [55, 65) is not all in yet
    landing.fail(SourceError("gone"))
    landing.finish(b"b" * 100)  # too late: a landing ends once
    for thread in threads:
        thread.join(WAIT_S)
    assert isinstance(out[55], SourceError) and isinstance(out[90], SourceError)
    got, early = landing.range(0, 10)  # bytes shown stay valid after a failure
    assert bytes(got) == b"a" * 10 and early
