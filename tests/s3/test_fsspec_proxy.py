"""faultfs::s3:// through ``LatencyProxy`` (moto behind it), its responses dropped or stalled
mid-body: a reader answered from the head of a chunk still landing, and a random reader's
fault split at its offset (``faultfs/fsspec/landing.py``), get exact bytes after bounded
retries, or an error — never zeros, never a hang — and the store keeps only whole, exact
chunks. Every check compares bytes with what was uploaded."""

from __future__ import annotations

import random
import time

import fsspec
import pytest

from faultfs.sources.retry import DEFAULT_RETRY
from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy

pytestmark = pytest.mark.s3
MiB = 1 << 20
READ_TIMEOUT_S = 0.5  # a stalled response's try ends after this
ONE_FAULT_S = DEFAULT_RETRY.attempts * READ_TIMEOUT_S + 3.0  # its tries and backoff sleeps


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def proxy(s3_env: str):
    host, _, port = s3_env.removeprefix("http://").partition(":")
    with LatencyProxy(host, int(port), delay_ms=5, conn_mbps=200, lifetime_s=600) as p:
        yield p


def faultfs(store, proxy: LatencyProxy):
    return fsspec.filesystem(
        "faultfs", target_protocol="s3", store=str(store), reserve_mb=0, chunk_size="1M",
        read_ahead=0, skip_instance_cache=True,
        target_options={"endpoint_url": proxy.url,
                        "config_kwargs": {"read_timeout": READ_TIMEOUT_S}})


def object_gets(bucket: str, key: str):
    prefix = f"/{bucket}/{key}"
    return lambda method, path: method == "GET" and (path == prefix
                                                     or path.startswith(prefix + "?"))


def test_split_faults_survive_dropped_and_stalled_responses(s3_client, make_bucket, proxy,
                                                            tmp_path):
    bucket = make_bucket()
    data = payload(12 * MiB - 999, 6)
    s3_client.put_object(Bucket=bucket, Key="run/field.bin", Body=data)
    gets = object_gets(bucket, "run/field.bin")
    fs = faultfs(tmp_path / "store", proxy)
    # a third of the GETs cut 20 kB into their body: the reader's part and the head's alike
    proxy.set_faults(FaultPlan(FaultRule("reset", fraction=0.34, after_bytes=20_000,
                                         match=gets)))
    with fs.open(f"{bucket}/run/field.bin") as f:
        for chunk in (1, 4, 7, 10):  # far into each chunk: its fault is split at the reader
            off = chunk * MiB + 700 * 1024 + 123
            f.seek(off)
            assert f.read(4096) == data[off:off + 4096]
        assert proxy.stats(log=False)["faults"]["reset"] >= 1
        stats = fs.stats()
        assert stats["split_faults"] >= 1 and stats["head_reads"] >= 1, stats
        # the heads of those chunks may still be on their way (retried after a reset): they
        # end before the stalls begin, or a stalled try of theirs would fail them as well
        assert fs.drain(30)

        # every response stalls: the split fault's reader gets an error after the bounded
        # tries of both parts, not zeros and not a hang
        proxy.set_faults(FaultPlan(FaultRule("stall", fraction=1.0, after_bytes=10_000,
                                             match=gets)))
        started = time.monotonic()
        f.seek(5 * MiB + 900 * 1024)
        with pytest.raises(OSError, match="failed after"):
            f.read(4096)
        assert time.monotonic() - started < ONE_FAULT_S + 5, "bounded: not a hang"
        proxy.set_faults(None)
        f.seek(0)
        assert f.read() == data, "every chunk whole and exact, the failed one faulted again"
    assert fs.drain(30)
    again = faultfs(tmp_path / "store", proxy)  # a new process's view: the store alone
    with again.open(f"{bucket}/run/field.bin") as f:
        assert f.read() == data
    assert again.stats().get("source_bytes", 0) == 0, "every chunk was stored whole"


def test_a_head_read_keeps_its_bytes_when_the_rest_of_the_chunk_fails(s3_client, make_bucket,
                                                                      proxy, tmp_path):
    bucket = make_bucket()
    data = payload(3 * MiB, 7)
    s3_client.put_object(Bucket=bucket, Key="run/head.bin", Body=data)
    fs = faultfs(tmp_path / "store", proxy)
    # every GET stalls 200 kB into its body: each try (resumed after the last 128 KiB piece
    # that landed) brings 128 KiB more, so the 1 MiB chunk never lands whole within the
    # bounded tries, while its first 128 KiB do at once
    proxy.set_faults(FaultPlan(FaultRule("stall", fraction=1.0, after_bytes=200_000,
                                         match=object_gets(bucket, "run/head.bin"))))
    with fs.open(f"{bucket}/run/head.bin") as f:
        started = time.monotonic()
        assert f.read(4096) == data[:4096], "answered from the chunk's head as it landed"
        assert time.monotonic() - started < READ_TIMEOUT_S, "before the first stall ended"
        assert fs.stats()["head_reads"] == 1
        f.seek(900 * 1024)  # past what any try brings: joins the fault, gets its error
        with pytest.raises(OSError, match="failed after"):
            f.read(4096)
        assert time.monotonic() - started < ONE_FAULT_S + 5, "bounded: not a hang"
        assert fs.drain(30)
        assert fs.stats().get("stored", 0) == 0, "nothing of the failed chunk was stored"
        proxy.set_faults(None)
        f.seek(0)
        assert f.read() == data
