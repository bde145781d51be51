"""S3 test fixtures: a moto server on loopback for the session, an s3fs-ready environment, buckets.

Invariants:
- The moto server listens on 127.0.0.1 on a free port and lives for the whole session.
- Each S3 test runs with fake credentials and AWS_ENDPOINT_URL pointing at moto, and with the
  developer's own ~/.aws files hidden, so nothing real is ever contacted.
- ``FaultyS3Proxy`` sits between a source and moto and fails chosen object reads (503 SlowDown
  or a dropped connection) — the failure fixture for retry tests.
"""

from __future__ import annotations

import collections
import http.client
import itertools
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

FAKE_KEY_ID = "AKIAFAULTFSTESTKEY01"
FAKE_SECRET = "faultfs-fake-secret-never-shown-0123456789"
REGION = "us-east-1"
_bucket_numbers = itertools.count()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory,
           moto_endpoint: str) -> Iterator[str]:
    """Environment an s3fs client reads: fake credentials, moto endpoint, no real AWS files."""

    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION",
                 "AWS_ENDPOINT_URL_S3", "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"):
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path_factory.mktemp("no-aws")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty / "credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    yield moto_endpoint
    from faultfs.sources import filesystems

    filesystems.clear_filesystems()


@dataclass(frozen=True)
class FakeAws:
    key_id: str = FAKE_KEY_ID
    secret: str = FAKE_SECRET
    region: str = REGION


@pytest.fixture
def fake_aws() -> FakeAws:
    """The fake credentials and region the S3 tests run with (to write profiles, find leaks)."""
    return FakeAws()


@pytest.fixture
def s3_client(s3_env: str):
    """A plain boto3 client on moto, for setting up and changing objects behind a source's back."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_env, region_name=REGION,
                        aws_access_key_id=FAKE_KEY_ID, aws_secret_access_key=FAKE_SECRET)


@pytest.fixture
def make_bucket(s3_client) -> Callable[..., str]:
    """``make_bucket(versioned=False) -> name``: a fresh, uniquely named bucket."""

    def make(versioned: bool = False) -> str:
        name = f"faultfs-test-{next(_bucket_numbers)}"
        s3_client.create_bucket(Bucket=name)
        if versioned:
            s3_client.put_bucket_versioning(
                Bucket=name, VersioningConfiguration={"Status": "Enabled"}
            )
        return name

    return make


class FaultyS3Proxy:
    """An HTTP proxy to moto that fails the next ``fail_reads`` ranged GETs.

    ``mode`` "503" answers with an S3 SlowDown error; "reset" closes the connection with no
    answer. ``range_gets`` counts every ranged GET that reached the proxy, ``gets_of[path]``
    those of one URL path (``/bucket/key``). With ``fail_path`` set, only ranged GETs of that
    path fail (and use up ``fail_reads``); the others pass through.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.removeprefix("http://")
        self.fail_reads = 0
        self.fail_path = ""
        self.mode = "503"
        self.range_gets = 0
        self.gets_of: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _forward(self) -> None:
                if self.command == "GET" and "Range" in self.headers:
                    path = self.path.partition("?")[0]
                    with proxy._lock:
                        proxy.range_gets += 1
                        proxy.gets_of[path] += 1
                        fail = proxy.fail_reads > 0 and path == (proxy.fail_path or path)
                        if fail:
                            proxy.fail_reads -= 1
                    if fail and proxy.mode == "reset":
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    if fail:
                        body = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown'
                                b"</Code><Message>Please reduce your request rate.</Message>"
                                b"</Error>")
                        self.send_response(503)
                        self.send_header("Content-Type", "application/xml")
                        self.send_header("Content-Length", str(len(body)))
                        self.end_headers()
                        self.wfile.write(body)
                        return
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(proxy.upstream, timeout=30)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    resp = conn.getresponse()
                    payload = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for name, value in resp.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length",
                                            "server", "date"):
                        self.send_header(name, value)
                # a HEAD answer carries the object's length, not the (empty) payload's
                length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def faulty_proxy(s3_env: str) -> Iterator[FaultyS3Proxy]:
    proxy = FaultyS3Proxy(s3_env)
    try:
        yield proxy
    finally:
        proxy.close()
