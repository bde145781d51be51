"""Non-S3 remote sources: HTTP(S) against a local server honouring Range, memory://, a flaky fs.

The HTTP server is real (``http_server``, a ``RangeHttpServer`` on 127.0.0.1) and speaks HTTP/1.1
with ETag, Last-Modified, If-Match and 206 ranges; switches make it forget ETags, ignore If-Match
or fail with 503.
"""

from __future__ import annotations

import errno
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import fsspec
import pytest
from conftest import check_concurrent_preads
from fsspec.implementations.memory import MemoryFileSystem

from faultfs.errors import InvalidInput, SourceError
from faultfs.sources import SourceOptions, SourceVersion, expand_sources, open_source
from faultfs.sources.remote import open_fsspec_source
from faultfs.sources.retry import RetryPolicy
from faultfs.sources.secrets import display_url
from faultfs.testing.httpd import RangeHttpServer

QUICK = RetryPolicy(attempts=3, base_delay_s=0.001, max_delay_s=0.005)


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


# --- HTTP ---


def test_http_open_version_and_range_reads(http_server: RangeHttpServer) -> None:
    data = payload(2 * 2**20 + 17, 1)
    url = http_server.put("/data/field.bin", data)
    src = open_source(url)
    assert src.url == url
    assert src.version() == SourceVersion(len(data), 'etag:"v1"')
    assert src.mtime() == 1_700_000_001
    for off, size in [(0, 1), (0, 2**20), (123_456, 654_321), (len(data) - 5, 5)]:
        assert src.pread(off, size) == data[off:off + size]
    assert src.pread(len(data) - 10, 100) == data[-10:]  # short read at the end
    assert src.pread(len(data), 100) == b""


def test_http_concurrent_reads(http_server: RangeHttpServer) -> None:
    data = payload(4 * 2**20, 2)
    check_concurrent_preads(open_source(http_server.put("/big", data)), data, 96, seed=3)


@pytest.mark.parametrize("honour_if_match", [True, False])
def test_http_changed_etag_fails_reads(http_server: RangeHttpServer, honour_if_match: bool) -> None:
    """A server that honours If-Match answers 412; one that ignores it is caught by the ETag."""
    http_server.honour_if_match = honour_if_match
    url = http_server.put("/f", payload(10_000, 4))
    src = open_source(url)
    http_server.put("/f", payload(10_000, 5))  # same size, new ETag
    with pytest.raises(SourceError, match="changed since it was opened") as info:
        src.pread(0, 100)
    assert info.value.errno == errno.EIO
    assert url in str(info.value)
    assert src.version() == SourceVersion(10_000, 'etag:"v2"')


def test_http_without_etag_pins_last_modified_and_size(http_server: RangeHttpServer) -> None:
    http_server.send_etag = False
    src = open_source(http_server.put("/f", payload(1000, 6)))
    assert src.version().token.startswith("lastmod:")
    http_server.put("/f", payload(1000, 7))
    with pytest.raises(SourceError, match="modified at"):
        src.pread(0, 10)
    src = open_source(http_server.put("/g", payload(1000, 8)))
    http_server.objects["/g"] = (payload(999, 9), *http_server.objects["/g"][1:])  # sneaky
    with pytest.raises(SourceError, match="size is now 999"):
        src.pread(0, 10)


def test_http_missing_at_open_and_after(http_server: RangeHttpServer) -> None:
    with pytest.raises(InvalidInput, match="does not exist") as info:
        open_source(f"{http_server.base}/nope")
    assert info.value.errno == errno.ENOENT
    src = open_fsspec_source(http_server.put("/f", b"abc"), SourceOptions(),
                             retry=RetryPolicy(attempts=5))
    del http_server.objects["/f"]
    gets = http_server.gets
    with pytest.raises(SourceError, match="changed since it was opened"):
        src.pread(0, 3)
    assert http_server.gets == gets + 1  # a 404 is not retried


def test_http_transient_errors_retried_then_bounded(http_server: RangeHttpServer) -> None:
    data = payload(50_000, 10)
    src = open_fsspec_source(http_server.put("/f", data), SourceOptions(), retry=QUICK)
    http_server.fail_next = 2
    gets = http_server.gets
    assert src.pread(100, 1000) == data[100:1100]
    assert http_server.gets == gets + 3
    http_server.fail_next = 1000
    start = time.monotonic()
    with pytest.raises(SourceError, match=r"failed after 3 tries: HTTP 503"):
        src.pread(0, 10)
    assert time.monotonic() - start < 2


def test_http_secrets_in_url_never_shown(http_server: RangeHttpServer) -> None:
    sig = "SIGNATURE-abcdef0123456789"
    path_url = http_server.put("/signed.bin", b"signed bytes")
    host = path_url.removeprefix("http://")
    url = f"http://alice:pa55w0rd-xyz@{host}?X-Amz-Signature={sig}&versionId=7"
    src = open_source(url)
    assert src.url == f"http://{host}?X-Amz-Signature=***&versionId=7"
    assert src.pread(0, 100) == b"signed bytes"
    version = repr(src.version())
    del http_server.objects["/signed.bin"]
    with pytest.raises(SourceError) as info:
        src.pread(0, 1)
    missing = f"http://{host.rpartition('/')[0]}/gone?token={sig}"
    with pytest.raises(InvalidInput) as open_err:
        open_source(missing)
    for text in (src.url, version, str(info.value), str(open_err.value)):
        assert sig not in text
        assert "pa55w0rd" not in text
    # a query's "?" is not a glob wildcard
    assert expand_sources([url]) == [url]


def test_display_url_redaction() -> None:
    assert display_url("s3://b/k") == "s3://b/k"
    assert display_url("https://u:p@h/x?a=1&versionId=v") == "https://h/x?a=***&versionId=v"
    assert display_url("/local/path") == "/local/path"


# --- memory:// and other plain fsspec file systems ---


def test_memory_source_reads_pins_and_globs() -> None:
    fs = fsspec.filesystem("memory")
    data = payload(300_000, 11)
    fs.pipe_file("/faultfs-mem/a.bin", data)
    src = open_source("memory://faultfs-mem/a.bin")
    assert src.version().size == len(data)
    assert src.version().token.startswith("created:")
    assert src.pread(1000, 5000) == data[1000:6000]
    assert src.pread(len(data) - 3, 10) == data[-3:]
    with ThreadPoolExecutor(16) as pool:
        offs = list(range(0, len(data), 7001))
        got = list(pool.map(lambda off: src.pread(off, 4096), offs))
    assert got == [data[o:o + 4096] for o in offs]
    time.sleep(0.001)  # a new memory file records a later creation time
    fs.pipe_file("/faultfs-mem/a.bin", payload(300_000, 12))
    with pytest.raises(SourceError, match="changed since it was opened"):
        src.pread(0, 10)
    with pytest.raises(InvalidInput, match="is a directory"):
        open_source("memory://faultfs-mem")
    with pytest.raises(InvalidInput, match="does not exist"):
        open_source("memory://faultfs-mem/nope.bin")
    for i in (2, 0, 1):
        fs.pipe_file(f"/faultfs-mem/shards/part-{i}.bin", b"%d" % i)
    fs.pipe_file("/faultfs-mem/shards/part-0.txt", b"not a shard")
    assert expand_sources(["memory://faultfs-mem/shards/part-*.bin"]) == [
        f"memory:///faultfs-mem/shards/part-{i}.bin" for i in range(3)
    ]
    with pytest.raises(InvalidInput, match="matches no file"):
        expand_sources(["memory://faultfs-mem/shards/*.h5"])


class FlakyMemoryFileSystem(MemoryFileSystem):
    """memory:// whose ``cat_file`` raises ``failure`` for the next ``fail_next`` calls."""

    protocol = "flakymem"
    fail_next = 0
    failure: type[Exception] = TimeoutError
    calls = 0

    @classmethod
    def _strip_protocol(cls, path):
        return MemoryFileSystem._strip_protocol(path.replace("flakymem://", "memory://", 1))

    def cat_file(self, path, start=None, end=None, **kwargs):
        cls = type(self)
        cls.calls += 1
        if cls.fail_next > 0:
            cls.fail_next -= 1
            raise cls.failure("injected")
        return super().cat_file(path, start=start, end=end, **kwargs)


@pytest.fixture
def flaky() -> Iterator[type[FlakyMemoryFileSystem]]:
    fsspec.register_implementation("flakymem", FlakyMemoryFileSystem, clobber=True)
    FlakyMemoryFileSystem.fail_next = 0
    FlakyMemoryFileSystem.calls = 0
    FlakyMemoryFileSystem.failure = TimeoutError
    fsspec.filesystem("memory").pipe_file("/faultfs-flaky/f.bin", b"0123456789")
    yield FlakyMemoryFileSystem
    FlakyMemoryFileSystem.fail_next = 0


def test_failing_wrapper_transient_then_success(flaky) -> None:
    src = open_fsspec_source("flakymem://faultfs-flaky/f.bin", SourceOptions(), retry=QUICK)
    flaky.fail_next = 2
    assert src.pread(2, 5) == b"23456"
    assert flaky.calls == 3


def test_failing_wrapper_always_failing_is_bounded(flaky) -> None:
    src = open_fsspec_source("flakymem://faultfs-flaky/f.bin", SourceOptions(), retry=QUICK)
    flaky.fail_next = 1000
    start = time.monotonic()
    with pytest.raises(SourceError, match="failed after 3 tries: TimeoutError"):
        src.pread(0, 5)
    assert flaky.calls == 3
    assert time.monotonic() - start < 2


def test_failing_wrapper_permanent_error_is_not_retried(flaky) -> None:
    src = open_fsspec_source("flakymem://faultfs-flaky/f.bin", SourceOptions(), retry=QUICK)
    flaky.failure = PermissionError
    flaky.fail_next = 1000
    with pytest.raises(SourceError, match="access denied"):
        src.pread(0, 5)
    assert flaky.calls == 1


def test_unknown_protocol_is_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="faultfs-nosuchproto"):
        open_source("faultfs-nosuchproto://x/y")
