"""The S3 object read path (``sources.s3`` and ``sources.s3http``) on moto, through
``LatencyProxy`` where a failure must strike mid-response: presigned GETs on kept-alive
connections, bytes told piece by piece as they land, a retry that asks only for what did
not land, the botocore fallback after a redirect, and error answers classified as before."""

from __future__ import annotations

import random

import pytest

from faultfs.buffers import Pieces
from faultfs.errors import SourceChanged, SourceError
from faultfs.sources import SourceOptions, open_source
from faultfs.sources.retry import DEFAULT_RETRY
from faultfs.sources.s3 import PROGRESS_STEP
from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy

pytestmark = pytest.mark.s3

MiB = 1 << 20


def payload(size: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(size)


@pytest.fixture
def proxy(s3_env: str):
    host, _, port = s3_env.removeprefix("http://").partition(":")
    with LatencyProxy(host, int(port), delay_ms=2, conn_mbps=None, lifetime_s=300) as p:
        yield p


def gets_of(path: str):
    return lambda method, target: method == "GET" and target.partition("?")[0] == path


def test_reads_are_presigned_gets_on_kept_alive_connections(s3_client, make_bucket, proxy,
                                                            monkeypatch):
    bucket = make_bucket()
    data = payload(3 * MiB + 7, 1)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    src = open_source(f"s3://{bucket}/k.bin")
    proxy.reset_stats()
    for off, size in [(0, 1), (5, MiB), (len(data) - 100, 100), (MiB, 2 * MiB)]:
        assert bytes(src.pread(off, size)) == data[off:off + size]
    stats = proxy.stats(log=True)
    gets = [r for r in stats["log"] if r["method"] == "GET"]
    assert len(gets) == 4
    assert all("X-Amz-Signature=" in r["path"] for r in gets), "presigned SigV4 URLs"
    assert not src._reader._botocore_only


class RangeServer:
    """HTTP/1.1 keep-alive server: ``GET`` with ``Range`` answers 206 with DATA's slice;
    ``connections`` counts accepted connections; ``close_after`` closes each connection
    after that many answers (a server's idle timeout)."""

    DATA = payload(MiB, 9)

    def __init__(self) -> None:
        import http.server
        import threading

        self.connections = 0
        self.close_after = 0
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                server.connections += 1
                self.answers = 0

            def do_GET(self) -> None:
                lo, _, hi = self.headers["Range"].removeprefix("bytes=").partition("-")
                body = server.DATA[int(lo):int(hi) + 1]
                self.send_response(206)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("ETag", '"e1"')
                self.send_header("Content-Range", f"bytes {lo}-{hi}/{len(server.DATA)}")
                self.end_headers()
                self.wfile.write(body)
                self.answers += 1
                if server.close_after and self.answers >= server.close_after:
                    self.close_connection = True

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/b/k?X-Amz-Signature=x"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeClient:
    def __init__(self, url: str) -> None:
        self.url = url

    def generate_presigned_url(self, operation: str, Params: dict, ExpiresIn: int) -> str:
        return self.url


def test_connections_are_kept_alive_and_a_closed_idle_one_is_replaced_at_once():
    from faultfs.sources.s3 import fill
    from faultfs.sources.s3http import ConnectionPool, PresignedGets

    server = RangeServer()
    pool = ConnectionPool(5.0, 5.0, lambda: None)
    gets = PresignedGets(FakeClient(server.url), pool, "b", "k")

    def get(start: int, end: int) -> bytes:
        resp, conn, where = gets.get(start, end, "", '"e1"')
        buf = memoryview(bytearray(end - start))
        fill(resp.readinto, buf, None, 1 << 16)
        gets.finish(conn, resp, where, True)
        return bytes(buf)

    try:
        for i in range(5):
            assert get(i * 1000, i * 1000 + 777) == server.DATA[i * 1000:i * 1000 + 777]
        assert server.connections == 1, "one kept-alive connection"
        server.close_after = 1  # the server now closes each connection after one answer
        for i in range(3):
            assert get(i, i + 10) == server.DATA[i:i + 10], "retried at once on a new one"
        assert server.connections >= 3
    finally:
        pool.close()
        server.close()


def test_pieces_are_told_as_they_land(s3_client, make_bucket):
    bucket = make_bucket()
    data = payload(3 * MiB + 500, 2)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=data)
    src = open_source(f"s3://{bucket}/k.bin")
    told: list[bytes] = []
    out = src.pread_stream(5, 10 * MiB, lambda first: told.append(bytes(first)), MiB)
    assert bytes(out) == data[5:]
    lengths = [len(t) for t in told]
    # every piece's end, and through the first piece every PROGRESS_STEP (the reader the
    # request is for hears of the head of its blob before the blob is whole)
    first = list(range(PROGRESS_STEP, MiB + 1, PROGRESS_STEP))
    assert lengths == [*first, 2 * MiB, 3 * MiB, 3 * MiB + 495]
    assert all(t == data[5:5 + len(t)] for t in told)


def test_a_connection_dropped_mid_body_is_retried_from_the_last_piece(
        s3_client, make_bucket, proxy, monkeypatch):
    bucket = make_bucket()
    data = payload(4 * MiB, 3)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    src = open_source(f"s3://{bucket}/k.bin")
    proxy.set_faults(FaultPlan(FaultRule("reset", requests=[1], after_bytes=5 * MiB // 2,
                                         match=gets_of(f"/{bucket}/k.bin"))))
    proxy.reset_stats()
    told: list[int] = []
    out = src.pread_stream(0, len(data), lambda first: told.append(len(first)), MiB)
    assert bytes(out) == data
    # what landed before the drop stays told: the lengths only grow, through every piece end
    assert told == sorted(set(told)) and {MiB, 2 * MiB, 3 * MiB, 4 * MiB} <= set(told)
    stats = proxy.stats(log=True)
    assert stats["faults"]["reset"] == 1
    # the retry asked for [2 MiB, 4 MiB): 2.5 MiB before the drop, 2 MiB after
    assert stats["response_bytes"] < 5 * MiB


def test_a_run_received_in_pieces_is_exact_across_a_drop_inside_a_piece(
        s3_client, make_bucket, proxy, monkeypatch):
    """Each MiB of a run lands in a buffer of its own (``Pieces``), and a connection dropped
    inside the first piece (after a progress step told) resumes there, filling the same
    piece up to its end and the next ones after it."""
    bucket = make_bucket()
    data = payload(4 * MiB - 300, 4)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    src = open_source(f"s3://{bucket}/k.bin")
    assert src.receives_in_pieces
    proxy.set_faults(FaultPlan(FaultRule("reset", requests=[1], after_bytes=PROGRESS_STEP + 5000,
                                         match=gets_of(f"/{bucket}/k.bin"))))
    told: list[int] = []
    out = src.pread_stream(0, len(data), lambda first: told.append(len(first)), MiB,
                           into=Pieces(len(data), MiB))
    assert isinstance(out, Pieces) and len(out) == len(data)
    blobs = [out[i * MiB:min(len(data), (i + 1) * MiB)] for i in range(4)]
    assert b"".join(bytes(b) for b in blobs) == data
    assert len({id(b.obj) for b in blobs}) == 4, "a buffer for each piece"
    assert told == sorted(set(told)) and {MiB, 2 * MiB, 3 * MiB, len(data)} <= set(told)
    assert proxy.stats()["faults"]["reset"] == 1


def test_a_redirect_falls_back_to_botocore_for_good(s3_client, make_bucket, proxy,
                                                    monkeypatch):
    bucket = make_bucket()
    data = payload(MiB, 4)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    src = open_source(f"s3://{bucket}/k.bin")
    proxy.set_faults(FaultPlan(FaultRule("status", requests=[1], status=400,
                                         code="AuthorizationHeaderMalformed",
                                         match=gets_of(f"/{bucket}/k.bin"))))
    assert bytes(src.pread(0, MiB)) == data
    assert src._reader._botocore_only, "read through botocore from then on"
    assert bytes(src.pread(10, 10)) == data[10:20]


def test_error_answers_are_classified(s3_client, make_bucket, proxy, monkeypatch):
    bucket = make_bucket()
    data = payload(MiB, 5)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=data)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    src = open_source(f"s3://{bucket}/k.bin")
    match = gets_of(f"/{bucket}/k.bin")
    # a throttling burst shorter than the bound is ridden out
    proxy.set_faults(FaultPlan(FaultRule("status", requests=[1, 2], status=503, match=match)))
    assert bytes(src.pread(0, 100)) == data[:100]
    # always throttled: bounded tries, then SourceError
    proxy.set_faults(FaultPlan(FaultRule("status", fraction=1.0, status=503, match=match)))
    proxy.reset_stats()
    with pytest.raises(SourceError, match=f"after {DEFAULT_RETRY.attempts} tries: "
                                          r"ServiceUnavailable \(HTTP 503\)"):
        src.pread(0, 100)
    assert proxy.stats(log=False)["faults"]["status"] == DEFAULT_RETRY.attempts
    # the object replaced behind the pin: the ETag no longer matches, never other bytes
    proxy.set_faults(None)
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=payload(MiB, 6))
    with pytest.raises(SourceChanged):
        src.pread(0, 100)


def test_the_s3_client_is_made_without_listing_every_service_botocore_ships(
        s3_client, make_bucket, monkeypatch):
    """botocore asks which services exist by listing every model directory it ships (~870
    listdirs here, 0.1-0.2 s of a new process's first S3 request): the S3 client's session
    asks about S3 alone, and the client still reads."""
    import os

    import botocore

    from faultfs.sources import filesystems

    bucket = make_bucket()
    s3_client.put_object(Bucket=bucket, Key="k.bin", Body=b"x" * 1000)
    data_dir = os.path.join(os.path.dirname(botocore.__file__), "data")
    listed = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda path=".": (
        listed.append(path) if str(path).startswith(data_dir) else None, real(path))[1])
    filesystems.clear_filesystems()  # a new client, as in a new process
    src = open_source(f"s3://{bucket}/k.bin")
    assert src.pread(10, 20) == b"x" * 20
    # with an explicit endpoint, reads need no client at all (sources/s3sign.py) ...
    assert listed == [], listed[:20]
    # ... and one made (another setting, a fallback) lists S3's models alone
    fs, _ = filesystems.filesystem_for(f"s3://{bucket}/k.bin", SourceOptions())
    assert filesystems.s3_client(fs).head_object(Bucket=bucket, Key="k.bin")["ContentLength"] \
        == 1000
    assert 0 < len(listed) < 10, listed[:20]


def test_a_head_without_a_client_pins_as_the_client_does(s3_client, make_bucket):
    """The presigned HEAD of a client-less presigner (sources/s3sign.py) gives the stat the
    client's head_object gives: size, ETag, version, time."""
    from faultfs.sources import filesystems
    from faultfs.sources.s3 import S3Reader

    for versioned in (False, True):
        bucket = make_bucket(versioned=versioned)
        s3_client.put_object(Bucket=bucket, Key="d/k 1.bin", Body=b"y" * 1234)
        fs, path = filesystems.filesystem_for(f"s3://{bucket}/d/k 1.bin", SourceOptions())
        reader = S3Reader(fs, path, str)
        light = reader._head_presigned()
        assert light is not None and light.size == 1234
        assert light.version_id if versioned else light.etag
        reader._botocore_only = True  # the client's head_object
        assert reader.stat() == light
