"""S3 mounts through ``LatencyProxy`` (moto behind it): a remote endpoint's round trip and
bandwidth, and its failures mid-response.

A dropped connection in the middle of a response while prefetch has many GETs in flight is
retried (from the last piece that landed) and never serves wrong bytes or zeros; a response
that stalls is timed out, retried, and after the bounded tries the read fails with EIO —
never a hang. Every check compares bytes with what was uploaded.
"""

from __future__ import annotations

import errno
import os
import random
import time

import pytest

from faultfs.sources.retry import DEFAULT_RETRY
from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy

pytestmark = [pytest.mark.mount, pytest.mark.s3]

MiB = 1 << 20
READ_TIMEOUT_S = 0.5  # the daemon's per-socket read timeout here (FAULTFS_SOURCE_READ_TIMEOUT_S)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


def read_view(path: str) -> bytes:
    """The whole file with 1 MiB reads (a sequential reader: prefetch runs ahead of it)."""
    out = bytearray()
    with open(path, "rb", buffering=0) as f:
        while piece := f.read(MiB):
            out += piece
    return bytes(out)


def log_text(store: str) -> str:
    with open(os.path.join(store, "log", "faultfs.log"), "rb") as f:
        return f.read().decode(errors="replace")


@pytest.fixture
def proxy(s3_env: str):
    host, _, port = s3_env.removeprefix("http://").partition(":")
    with LatencyProxy(host, int(port), delay_ms=5, conn_mbps=200, lifetime_s=600) as p:
        yield p


def object_gets(bucket: str, key: str):
    """A FaultRule ``match`` for the GETs of one object (presigned or not: the query is
    part of the path the proxy sees)."""
    prefix = f"/{bucket}/{key}"
    return lambda method, path: method == "GET" and (path == prefix
                                                     or path.startswith(prefix + "?"))


def test_a_dropped_connection_mid_response_is_retried_and_never_serves_wrong_bytes(
        s3_env, s3_client, make_bucket, mounter, proxy, tmp_path):
    bucket = make_bucket()
    data = payload(18 * MiB - 4321, 1)  # the last chunk too is more than 1 MiB
    s3_client.put_object(Bucket=bucket, Key="run/field.bin", Body=data)
    # 2 MiB chunks: every GET (a reader's fault or one of the prefetches the window keeps in
    # flight) has a body of 2 MiB or more, so the 6th GET of the object is cut mid-response,
    # 1 MiB into its body
    proxy.set_faults(FaultPlan(FaultRule("reset", requests=[6], after_bytes=MiB,
                                         match=object_gets(bucket, "run/field.bin"))))
    m = mounter(f"s3://{bucket}/run/field.bin",
                args=["--chunk-size", "2M", "--s3-endpoint-url", proxy.url])
    proxy.reset_stats()
    got = read_view(os.path.join(m.tag("field"), "field.bin"))
    assert len(got) == len(data)
    assert got == data, "byte-exact: no zeros, no bytes of another range"
    stats = proxy.stats(log=True)
    assert stats["faults"]["reset"] == 1, "the connection was dropped once"
    [cut] = [r for r in stats["log"] if r["fault"] == "reset"]
    assert not cut["complete"] and cut["response_bytes"] >= MiB, "mid-response"
    assert stats["peak_in_flight"] >= 2, "prefetch had GETs in flight"
    c = m.counters()
    assert c["fault_errors"] == 0, "the retry hid the dropped connection from the reader"
    assert c["prefetches"] > 0
    # the retry read one request's bytes again, no more
    assert stats["response_bytes"] < len(data) + 3 * MiB
    # and the bytes staged from the retried request are right too (read from the store after
    # a remount)
    m.umount()
    m2 = mounter(store=m.store, mountpoint=m.path)
    assert read_view(os.path.join(m2.tag("field"), "field.bin")) == data
    assert m2.counters()["source_reads"] == 0, "everything was staged by the first mount"


def test_a_stalled_response_times_out_is_retried_then_fails_with_eio(
        s3_env, s3_client, make_bucket, mounter, proxy, monkeypatch):
    bucket = make_bucket()
    data = payload(6 * MiB, 2)  # 1 MiB chunks
    s3_client.put_object(Bucket=bucket, Key="run/field.bin", Body=data)
    monkeypatch.setenv("FAULTFS_SOURCE_READ_TIMEOUT_S", str(READ_TIMEOUT_S))
    m = mounter(f"s3://{bucket}/run/field.bin",
                args=["--chunk-size", "1M", "--s3-endpoint-url", proxy.url])
    tag = m.tag("field")

    # one stalled response: timed out after READ_TIMEOUT_S, retried, the read succeeds
    proxy.set_faults(FaultPlan(FaultRule("stall", requests=[1], after_bytes=100_000,
                                         match=object_gets(bucket, "run/field.bin"))))
    started = time.monotonic()
    with open(os.path.join(tag, "chunk_2"), "rb") as f:
        assert f.read() == data[2 * MiB:3 * MiB]
    assert READ_TIMEOUT_S <= time.monotonic() - started < 10 * READ_TIMEOUT_S
    assert proxy.stats(log=False)["faults"]["stall"] == 1
    assert m.counters()["fault_errors"] == 0

    # every response stalls: bounded tries, then EIO — never a hang, never zeros
    proxy.set_faults(FaultPlan(FaultRule("stall", fraction=1.0, after_bytes=100_000,
                                         match=object_gets(bucket, "run/field.bin"))))
    proxy.reset_stats()
    started = time.monotonic()
    fd = os.open(os.path.join(tag, "chunk_5"), os.O_RDONLY)  # not next to chunk_2: no prefetch
    try:
        with pytest.raises(OSError) as exc:
            os.pread(fd, 4096, 0)
    finally:
        os.close(fd)
    elapsed = time.monotonic() - started
    assert exc.value.errno == errno.EIO
    # the kernel tries a failed read once more itself: at most two bounded faults
    one_fault = DEFAULT_RETRY.attempts * READ_TIMEOUT_S + 3.0  # tries + the backoff sleeps
    assert elapsed < 2 * one_fault + 5, "bounded: not a hang"
    assert proxy.stats(log=False)["faults"]["stall"] in (DEFAULT_RETRY.attempts,
                                                         2 * DEFAULT_RETRY.attempts)
    assert m.counters()["fault_errors"] >= 1
    assert f"failed after {DEFAULT_RETRY.attempts} tries" in log_text(m.store)

    # the endpoint recovers: the failed chunk was never staged, it faults again, right bytes
    proxy.set_faults(None)
    with open(os.path.join(tag, "field.bin"), "rb") as f:
        assert f.read() == data
    assert m.stats()["pid"] == m.pid, "the same daemon serves on"
