"""LatencyProxy: delay, pacing, stats, faults and HTTP/1.1 framing, checked against a plain local
upstream, plus one boto3 round through moto. Tolerance checks, not benchmarks: the bounds are
wide enough for two shared cores, tight enough to catch a missing delay or cap."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from faultfs.testing.proxy import FaultPlan, FaultRule, LatencyProxy

ROOT = Path(__file__).resolve().parent.parent
DATA = random.Random(20240611).randbytes(24 << 20)  # bodies are prefixes of this
TRAILER = b"X-Checksum: done\r\n"


class Upstream:
    """An HTTP/1.1 server on 127.0.0.1: ``GET|HEAD /bytes/N`` answers ``DATA[:N]``;
    ``GET /chunked/N/K`` the same N bytes in chunks of K, with a trailer; ``GET /status/204``;
    ``PUT|POST /echo`` answers the request body back (Content-Length or chunked) and keeps the
    body's bytes as they came, framing included, in ``raw_bodies``. ``hits`` counts requests."""

    def __init__(self) -> None:
        self.hits = 0
        self.raw_bodies: list[bytes] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # else a head and a small body wait 40 ms for an ACK

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _head(self, status: int, length: int | None, chunked: bool = False) -> None:
                upstream.hits += 1
                self.send_response(status)
                if length is not None:
                    self.send_header("Content-Length", str(length))
                if chunked:
                    self.send_header("Transfer-Encoding", "chunked")
                    self.send_header("Trailer", "X-Checksum")
                self.end_headers()

            def do_HEAD(self) -> None:
                self._head(200, int(self.path.rsplit("/", 1)[1]))

            def do_GET(self) -> None:
                parts = self.path.split("/")
                if parts[1] == "bytes":
                    n = int(parts[2])
                    self._head(200, n)
                    self.wfile.write(memoryview(DATA)[:n])
                elif parts[1] == "chunked":
                    n, k = int(parts[2]), int(parts[3])
                    self._head(200, None, chunked=True)
                    for at in range(0, n, k):
                        piece = DATA[at:min(n, at + k)]
                        self.wfile.write(b"%X;ext=1\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.write(b"0\r\n" + TRAILER + b"\r\n")
                else:
                    self._head(int(parts[2]), None)

            def do_PUT(self) -> None:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raw, body = self._read_chunked()
                else:
                    raw = body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                upstream.raw_bodies.append(raw)
                self._head(200, len(body))
                self.wfile.write(body)

            do_POST = do_PUT

            def _read_chunked(self) -> tuple[bytes, bytes]:
                raw, body = [], []
                while True:
                    line = self.rfile.readline()
                    raw.append(line)
                    size = int(line.split(b";")[0], 16)
                    if size == 0:
                        while raw[-1] != b"\r\n":
                            raw.append(self.rfile.readline())
                        return b"".join(raw), b"".join(body)
                    data = self.rfile.read(size + 2)
                    raw.append(data)
                    body.append(data[:-2])

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 64  # the default 5 drops parallel connects for 1 s (SYN retry)

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # the proxy drops connections on purpose

        self._server = Server(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    try:
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def proxy_to(upstream: Upstream, **options) -> Iterator[LatencyProxy]:
    with LatencyProxy("127.0.0.1", upstream.port, **options) as proxy:
        yield proxy


@contextlib.contextmanager
def client(proxy: LatencyProxy, timeout: float = 10) -> Iterator[http.client.HTTPConnection]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=timeout)
    try:
        yield conn
    finally:
        conn.close()


def fetch(conn: http.client.HTTPConnection, path: str, method: str = "GET",
          body: bytes | None = None) -> tuple[int, bytes, float]:
    start = time.monotonic()
    conn.request(method, path, body=body)
    resp = conn.getresponse()
    data = resp.read()
    return resp.status, data, time.monotonic() - start


def read_to_end(sock: socket.socket) -> tuple[bytes, OSError | None]:
    """What ``sock`` receives until the end, and the error (a reset, a timeout) that ended it."""
    got = bytearray()
    try:
        while data := sock.recv(1 << 16):
            got += data
    except OSError as exc:
        return bytes(got), exc
    return bytes(got), None


def raw_exchange(port: int, request: bytes, timeout: float = 5) -> tuple[bytes, OSError | None]:
    """Send ``request`` on a fresh socket and read until the end, an error or a timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(request)
        return read_to_end(sock)


def split_head(raw: bytes) -> tuple[bytes, bytes]:
    head, sep, body = raw.partition(b"\r\n\r\n")
    assert sep, raw[:200]
    return head, body


# -- delay --


def test_a_small_get_waits_the_delay(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=60) as proxy, client(proxy) as conn:
        status, data, took = fetch(conn, "/bytes/1")
        assert (status, data) == (200, DATA[:1])
        assert 0.060 <= took < 0.060 + 0.15
        [rec] = proxy.stats()["log"]
        assert rec["first_byte"] - rec["start"] >= 0.060
        assert rec["start"] <= rec["first_byte"] <= rec["end"]


def test_every_request_of_a_keep_alive_connection_waits_the_delay(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=40) as proxy, client(proxy) as conn:
        for size in (1, 1000, 1, 70_000):
            status, data, took = fetch(conn, f"/bytes/{size}")
            assert (status, data) == (200, DATA[:size])
            assert 0.040 <= took < 0.040 + 0.12
        stats = proxy.stats()
        assert (stats["requests"], stats["served"], stats["connections_total"]) == (4, 4, 1)


def test_no_delay_and_no_cap(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=0, conn_mbps=None) as proxy, client(proxy) as conn:
        fetch(conn, "/bytes/1")
        status, data, took = fetch(conn, f"/bytes/{8 << 20}")
        assert (status, data) == (200, DATA[:8 << 20])
        assert took < 0.5  # uncapped: hundreds of MB/s on loopback, not 100


# -- bandwidth --


def test_one_connection_is_paced_to_its_cap(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=0, conn_mbps=50) as proxy, client(proxy) as conn:
        status, data, took = fetch(conn, "/bytes/20000000")  # 0.4 s at 50 MB/s
        assert status == 200 and data == DATA[:20_000_000]
        assert 0.35 <= took <= 1.5
        assert proxy.stats()["response_bytes"] > 20_000_000


def _parallel_gets(proxy: LatencyProxy, count: int, size: int) -> tuple[float, list[float]]:
    took: list[float] = [0.0] * count
    ready = threading.Barrier(count + 1)

    def one(i: int) -> None:
        with client(proxy) as conn:
            fetch(conn, "/bytes/1")  # connected and warm before the clock starts
            ready.wait()
            status, data, took[i] = fetch(conn, f"/bytes/{size}")
            assert status == 200 and len(data) == size

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    ready.wait()
    start = time.monotonic()
    for t in threads:
        t.join()
    return time.monotonic() - start, took


def test_each_connection_has_its_own_cap(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=0, conn_mbps=40) as proxy:
        wall, took = _parallel_gets(proxy, 2, 8_000_000)  # 0.2 s each, side by side
    assert all(0.17 <= t for t in took)
    assert wall < 0.34  # shared, one cap would take 0.4 s


def test_the_total_cap_bounds_the_sum(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=0, conn_mbps=40, total_mbps=40) as proxy:
        wall, took = _parallel_gets(proxy, 2, 8_000_000)  # 16 MB at 40 MB/s: 0.4 s
    assert 0.36 <= wall <= 1.2
    assert all(t >= 0.3 for t in took)  # shared fairly, not one after the other


# -- stats --


def test_stats_count_requests_bytes_and_in_flight(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=30, conn_mbps=20) as proxy:
        proxy.reset_stats()
        _parallel_gets(proxy, 3, 2_000_000)  # 0.1 s of pacing each
        stats = proxy.stats()
        assert stats["requests"] == stats["served"] == 6
        assert stats["peak_in_flight"] == 3 and stats["in_flight"] == 0
        assert 0 < stats["avg_in_flight"] < 3
        assert stats["response_bytes"] > 3 * 2_000_000
        assert stats["request_bytes"] > 6 * len(b"GET /bytes/1 HTTP/1.1\r\n\r\n")
        big = [r for r in stats["log"] if r["path"] == "/bytes/2000000"]
        assert len(big) == 3
        for rec in big:
            assert (rec["method"], rec["status"], rec["complete"], rec["fault"]) == (
                "GET", 200, True, None)
            assert rec["response_bytes"] > 2_000_000
            assert rec["first_byte"] - rec["start"] >= 0.030
            assert rec["end"] - rec["first_byte"] >= 0.08
        proxy.reset_stats()
        stats = proxy.stats()
        assert (stats["requests"], stats["log"], stats["peak_in_flight"]) == (0, [], 0)


def test_the_proxy_stops_after_its_lifetime(upstream: Upstream) -> None:
    proxy = LatencyProxy("127.0.0.1", upstream.port, lifetime_s=0.3).start()
    try:
        port = proxy.port
        assert proxy.wait(3)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        proxy.close()


def test_idle_and_excess_connections_are_closed(upstream: Upstream) -> None:
    with proxy_to(upstream, idle_timeout_s=0.4, max_connections=1) as proxy:
        start = time.monotonic()  # the idle connection's clock starts at its accept
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as idle:
            with socket.create_connection(("127.0.0.1", proxy.port), timeout=3) as excess:
                assert read_to_end(excess)[0] == b""  # closed (or reset) at once
            assert read_to_end(idle)[0] == b""
            assert 0.4 <= time.monotonic() - start < 2.0
        stats = proxy.stats()
        assert (stats["connections_total"], stats["refused_connections"]) == (1, 1)


def test_an_unreachable_upstream_gets_a_502(upstream: Upstream) -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = unused.getsockname()[1]
        with LatencyProxy("127.0.0.1", port, delay_ms=0) as proxy, client(proxy) as conn:
            status, body, _ = fetch(conn, "/bytes/1")
            assert status == 502 and b"<Code>BadGateway</Code>" in body
            assert proxy.stats()["upstream_errors"] == 1


# -- faults --


def test_reset_drops_the_connection_after_n_body_bytes(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("reset", requests={1}, after_bytes=1000))
    with proxy_to(upstream, delay_ms=0, faults=plan) as proxy:
        raw, error = raw_exchange(proxy.port, b"GET /bytes/100000 HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = split_head(raw)
        assert head.startswith(b"HTTP/1.1 200") and body == DATA[:1000]
        assert isinstance(error, ConnectionResetError)
        with client(proxy) as conn:  # only the first request was chosen
            assert fetch(conn, "/bytes/100000")[:2] == (200, DATA[:100000])
        stats = proxy.stats()
        assert stats["faults"]["reset"] == 1
        assert [r["fault"] for r in stats["log"]] == ["reset", None]


def test_a_reset_waits_for_a_slow_reader_to_get_the_bytes_sent(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("reset", requests={1}, after_bytes=2_000_000))
    with proxy_to(upstream, delay_ms=0, conn_mbps=None, faults=plan) as proxy:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the rest waits
            sock.settimeout(5)  # in the proxy's send queue, which a bare RST would discard
            sock.connect(("127.0.0.1", proxy.port))
            sock.sendall(b"GET /bytes/3000000 HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)
            got, error = read_to_end(sock)
        assert split_head(got)[1] == DATA[:2_000_000]
        assert isinstance(error, ConnectionResetError)


def test_reset_before_the_head_answers_nothing(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("reset", requests={1}, after_bytes=None))
    with proxy_to(upstream, delay_ms=0, faults=plan) as proxy, client(proxy) as conn:
        hits = upstream.hits
        with pytest.raises(ConnectionResetError):  # RemoteDisconnected is one too
            fetch(conn, "/bytes/10")
        assert upstream.hits == hits + 1  # the upstream saw it; its answer was lost


def test_stall_forever_keeps_the_connection_open_and_close_is_prompt(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("stall", requests={1}, after_bytes=500, stall_s=None))
    proxy = LatencyProxy("127.0.0.1", upstream.port, delay_ms=0, faults=plan).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=0.3) as sock:
            sock.sendall(b"GET /bytes/5000 HTTP/1.1\r\nHost: x\r\n\r\n")
            got, error = read_to_end(sock)
            assert isinstance(error, TimeoutError)
            assert split_head(got)[1] == DATA[:500]
            assert proxy.stats()["faults"]["stall"] == 1
            start = time.monotonic()
            proxy.close()
            assert time.monotonic() - start < 1.0
            sock.settimeout(2)
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1 << 16) == b""  # the proxy closed it
    finally:
        proxy.close()


def test_a_timed_stall_before_the_head_delays_a_whole_answer(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("stall", requests={2}, after_bytes=None, stall_s=0.3))
    with proxy_to(upstream, delay_ms=0, faults=plan) as proxy, client(proxy) as conn:
        assert fetch(conn, "/bytes/10")[2] < 0.2
        status, data, took = fetch(conn, "/bytes/10")
        assert (status, data) == (200, DATA[:10]) and took >= 0.3
        assert proxy.stats()["faults"]["stall"] == 1


def test_status_answers_an_s3_error_without_asking_the_upstream(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("status", requests={1}, status=503))
    with proxy_to(upstream, delay_ms=20, faults=plan) as proxy, client(proxy) as conn:
        hits = upstream.hits
        status, body, took = fetch(conn, "/bytes/10")
        assert status == 503 and took >= 0.020
        assert b"<Error><Code>ServiceUnavailable</Code>" in body
        assert upstream.hits == hits
        assert fetch(conn, "/bytes/10")[:2] == (200, DATA[:10])  # the connection lives on
        assert proxy.stats()["faults"]["status"] == 1


def test_status_for_matching_requests_only_and_the_body_is_not_forwarded(
        upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("status", fraction=1.0, status=500,
                               match=lambda method, path: method == "PUT"))
    with proxy_to(upstream, delay_ms=0, faults=plan) as proxy, client(proxy) as conn:
        bodies = len(upstream.raw_bodies)
        status, body, _ = fetch(conn, "/echo", "PUT", DATA[:300_000])
        assert status == 500 and b"<Code>InternalError</Code>" in body
        assert len(upstream.raw_bodies) == bodies
        assert fetch(conn, "/echo", "POST", b"abc")[:2] == (200, b"abc")
        assert fetch(conn, "/bytes/3")[:2] == (200, DATA[:3])
        assert proxy.stats()["faults"]["status"] == 1


def test_truncate_sends_the_real_length_and_half_the_body(upstream: Upstream) -> None:
    plan = FaultPlan(FaultRule("truncate", requests={1, 2}))
    with proxy_to(upstream, delay_ms=0, faults=plan) as proxy:
        with client(proxy) as conn:
            conn.request("GET", "/bytes/10000")
            resp = conn.getresponse()
            assert resp.getheader("Content-Length") == "10000"
            with pytest.raises(http.client.IncompleteRead) as info:
                resp.read()
            assert info.value.partial == DATA[:5000]
        with client(proxy) as conn:  # chunked: all but the last chunk
            conn.request("GET", "/chunked/10000/3000")
            with pytest.raises(http.client.IncompleteRead):
                conn.getresponse().read()
        assert proxy.stats()["faults"]["truncate"] == 2


def test_faults_by_fraction_repeat_with_the_seed(upstream: Upstream) -> None:
    def pattern(proxy: LatencyProxy) -> list[int]:
        with client(proxy) as conn:
            return [fetch(conn, "/bytes/1")[0] for _ in range(30)]

    plan = FaultPlan(FaultRule("status", fraction=0.5), seed=3)
    with proxy_to(upstream, delay_ms=0, faults=plan) as proxy:
        first = pattern(proxy)
        proxy.set_faults(plan)  # counts and draws start afresh
        assert pattern(proxy) == first
        proxy.set_faults(FaultPlan(FaultRule("status", fraction=0.5), seed=4))
        assert pattern(proxy) != first
        proxy.set_faults(None)
        assert set(pattern(proxy)) == {200}
    assert 5 <= first.count(503) <= 25


# -- HTTP/1.1 framing --


def test_head_and_204_have_no_body_on_a_kept_connection(upstream: Upstream) -> None:
    with proxy_to(upstream, delay_ms=0) as proxy, client(proxy) as conn:
        conn.request("HEAD", "/bytes/5000")
        resp = conn.getresponse()
        assert resp.getheader("Content-Length") == "5000" and resp.read() == b""
        assert fetch(conn, "/status/204")[:2] == (204, b"")
        assert fetch(conn, "/bytes/7")[:2] == (200, DATA[:7])
        assert proxy.stats()["connections_total"] == 1


def test_a_put_body_is_forwarded_byte_exact(upstream: Upstream) -> None:
    body = DATA[1:3_000_001]
    with proxy_to(upstream, delay_ms=0, conn_mbps=None) as proxy, client(proxy) as conn:
        status, echoed, _ = fetch(conn, "/echo", "PUT", body)
        assert status == 200 and echoed == body
        assert hashlib.sha256(upstream.raw_bodies[-1]).digest() == hashlib.sha256(body).digest()
        assert proxy.stats()["request_bytes"] > len(body)


def test_chunked_bodies_pass_byte_exact(upstream: Upstream) -> None:
    pieces = [DATA[:1], DATA[1:70_000], DATA[70_000:70_100], DATA[100:1_000_000]]
    framed = b"".join(b"%X\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    with proxy_to(upstream, delay_ms=0, conn_mbps=None) as proxy:
        with client(proxy) as conn:
            conn.request("PUT", "/echo", body=iter(pieces))  # an iterable goes chunked
            resp = conn.getresponse()
            assert resp.read() == b"".join(pieces)
        assert upstream.raw_bodies[-1] == framed
        request = b"GET /chunked/200000/65536 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        direct = split_head(raw_exchange(upstream.port, request)[0])[1]
        proxied = split_head(raw_exchange(proxy.port, request)[0])[1]
    assert proxied == direct and direct.endswith(b"0\r\n" + TRAILER + b"\r\n")


def test_expect_100_continue_gets_through(upstream: Upstream) -> None:
    body = DATA[:50_000]
    with proxy_to(upstream, delay_ms=20) as proxy:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as sock:
            sock.sendall(b"PUT /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            assert sock.recv(1 << 16).startswith(b"HTTP/1.1 100")
            sock.sendall(body)
            got = b""
            while len(got) < len(body) or b"\r\n\r\n" not in got:
                got += sock.recv(1 << 16)
                if got.count(b"\r\n\r\n") and len(split_head(got)[1]) >= len(body):
                    break
        head, echoed = split_head(got)
        assert head.startswith(b"HTTP/1.1 200") and echoed == body


def test_cli_prints_its_url_and_runs_until_killed(upstream: Upstream) -> None:
    cmd = [sys.executable, "-m", "faultfs.testing.proxy", "--upstream",
           f"127.0.0.1:{upstream.port}", "--delay-ms", "5", "--lifetime-s", "60"]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            url = proc.stdout.readline().strip()
            assert url.startswith("http://127.0.0.1:")
            conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=5)
            try:
                assert fetch(conn, "/bytes/10")[:2] == (200, DATA[:10])
            finally:
                conn.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
            assert "served 1 of 1 requests" in proc.stderr.read()
        finally:
            proc.kill()


# -- a real S3 client --


@pytest.mark.s3
def test_boto3_through_the_proxy_to_moto(monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path) -> None:
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config
    from moto.server import ThreadedMotoServer

    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN",
                 "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))  # none of the user's own
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        with LatencyProxy(host, port, delay_ms=50) as proxy:
            s3 = boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1",
                              aws_access_key_id="AKIAFAULTFSPROXYTEST",
                              aws_secret_access_key="fake-secret-for-moto-only",
                              config=Config(retries={"max_attempts": 1}))
            try:
                s3.create_bucket(Bucket="proxied")
                body = DATA[:1_500_000]
                s3.put_object(Bucket="proxied", Key="k", Body=body)
                assert s3.head_object(Bucket="proxied", Key="k")["ContentLength"] == len(body)
                got = s3.get_object(Bucket="proxied", Key="k", Range="bytes=1000-1999")
                assert got["Body"].read() == body[1000:2000]
                start = time.monotonic()
                one = s3.get_object(Bucket="proxied", Key="k", Range="bytes=5-5")["Body"].read()
                took = time.monotonic() - start
                assert one == body[5:6] and 0.050 <= took < 0.5
                stats = proxy.stats()
                assert stats["served"] == stats["requests"] >= 5
                assert {r["method"] for r in stats["log"]} >= {"PUT", "HEAD", "GET"}
            finally:
                s3.close()
    finally:
        moto.stop()
