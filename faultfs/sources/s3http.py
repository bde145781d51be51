"""Ranged GETs of S3 objects as plain HTTP/1.1 requests to presigned URLs, on kept-alive
connections: the object read path without botocore's per-request machinery.

botocore spends about 2 ms of CPU on each request (its event hooks, request building,
signing and response parsing), a quarter of what moving a 2 MiB body costs; a GET of a
presigned URL on a kept-alive ``http.client`` connection costs about a fifth of that. The
client still decides everything that makes the request right: the URL (endpoint, region,
addressing style, version id) and its signature come from ``generate_presigned_url`` of the
same botocore client (``filesystems.s3_client``), made again every ``URL_REUSE_S``, so
refreshed credentials are used as botocore refreshes them.

Invariants:
- Only ``Range`` and ``If-Match`` go beside the presigned URL: S3 accepts unsigned headers
  that are not ``x-amz-*``, and no other header is needed to read an object.
- A connection is reused only after a whole response was read from it; any failure closes
  it. A kept-alive connection the server closed meanwhile is retried once, at once, on a new
  one (that is not a failure of the endpoint).
- An error answer becomes a botocore ``ClientError`` with the status and the S3 error code of
  its body, so it is classified as the botocore path's errors are. A redirect (another
  region) raises ``UseBotocore``: that object is read through botocore from then on, which
  follows it.
- Not used (``usable`` is False) when the client would go through an HTTP proxy or carries
  settings this path does not reproduce (client certificates, requester pays, extra request
  arguments): then every read goes through botocore.
"""

from __future__ import annotations

import http.client
import os
import re
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

URL_REUSE_S = 60.0  # a presigned URL is made again after this (it is valid for URL_EXPIRES_S)
URL_EXPIRES_S = 900
MAX_IDLE = 64  # kept-alive connections per endpoint, at most (the engine's concurrency)
ERROR_BODY_LIMIT = 64 << 10  # an S3 error document is a few hundred bytes
REDIRECT_CODES = frozenset({"PermanentRedirect", "TemporaryRedirect", "Redirect",
                            "AuthorizationHeaderMalformed", "IllegalLocationConstraintException"})


class UseBotocore(Exception):
    """This object cannot be read by this path (a redirect, an unusual answer): use botocore."""


class ConnectionPool:
    """Idle kept-alive connections per (scheme, host, port), most recently used first."""

    def __init__(self, connect_timeout: float, read_timeout: float,
                 ssl_context: Callable[[], ssl.SSLContext]) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._ssl_factory = ssl_context
        self._ssl: ssl.SSLContext | None = None  # made at the first https connection
        self._idle: dict[tuple[str, str, int], list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()

    def take(self, where: tuple[str, str, int]) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection to ``where`` (True: it was used before), or a new one."""
        with self._lock:
            idle = self._idle.get(where)
            if idle:
                return idle.pop(), True
        scheme, host, port = where
        conn: http.client.HTTPConnection
        if scheme == "https":
            with self._lock:
                if self._ssl is None:
                    self._ssl = self._ssl_factory()
            conn = http.client.HTTPSConnection(host, port, timeout=self.connect_timeout,
                                               context=self._ssl)
        else:
            conn = http.client.HTTPConnection(host, port, timeout=self.connect_timeout)
        return conn, False

    def give(self, where: tuple[str, str, int], conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(where, [])
            if len(idle) < MAX_IDLE:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            for idle in self._idle.values():
                for conn in idle:
                    conn.close()
            self._idle.clear()


def ssl_context_for(fs: Any) -> ssl.SSLContext:
    """Certificate checks as botocore makes them: ``verify`` of the client arguments (False,
    or a CA bundle path), else AWS_CA_BUNDLE, else botocore's default bundle."""
    verify = fs.client_kwargs.get("verify", None)
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    bundle = os.environ.get("AWS_CA_BUNDLE")
    if bundle:
        return ssl.create_default_context(cafile=bundle)
    from botocore.httpsession import get_cert_path

    return ssl.create_default_context(cafile=get_cert_path(True))


def usable(fs: Any, client: Any, endpoint: str = "") -> bool:
    """Whether reads of ``fs``'s objects may take this path (see the module invariants):
    ``client`` its botocore client, or None and ``endpoint`` (``sources.s3sign``)."""
    if fs.requester_pays or fs.s3_additional_kwargs or fs.client_kwargs.get("client_cert"):
        return False
    if client is not None:
        if getattr(client.meta.config, "proxies", None):
            return False
        endpoint = client.meta.endpoint_url
    host = urllib.parse.urlsplit(endpoint).hostname or ""
    proxies = urllib.request.getproxies()
    return not proxies or bool(urllib.request.proxy_bypass(host))


class PresignedGets:
    """Ranged GETs of one object (bucket, key, version) through presigned URLs."""

    def __init__(self, client: Any, pool: ConnectionPool, bucket: str, key: str) -> None:
        self._client = client
        self._pool = pool
        self._bucket = bucket
        self._key = key
        self._lock = threading.Lock()
        self._urls: dict[str, tuple[float, tuple[str, str, int], str]] = {}

    def _target(self, version_id: str) -> tuple[tuple[str, str, int], str]:
        """(where, request target) of a fresh enough presigned URL of the object."""
        now = time.monotonic()
        with self._lock:
            made = self._urls.get(version_id)
            if made is not None and now - made[0] < URL_REUSE_S:
                return made[1], made[2]
        params = {"Bucket": self._bucket, "Key": self._key}
        if version_id:
            params["VersionId"] = version_id
        where, target = split_url(self._client.generate_presigned_url(
            "get_object", Params=params, ExpiresIn=URL_EXPIRES_S))
        with self._lock:
            self._urls[version_id] = (now, where, target)
        return where, target

    def get(self, start: int, end: int, version_id: str, etag: str
            ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection, tuple[str, str, int]]:
        """Send the GET of ``[start, end)`` and read the answer's head. The caller reads the
        body and then ``finish``es (True: the whole body was read) — or on an error answer
        this raises (``ClientError``, ``UseBotocore``, or the transport's error)."""
        where, target = self._target(version_id)
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if etag and not version_id:
            headers["If-Match"] = etag
        resp, conn = send(self._pool, where, "GET", target, headers)
        if resp.status in (200, 206):
            return resp, conn, where
        try:
            raise answer_error(resp, "GetObject")
        finally:
            conn.close()

    def finish(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
               where: tuple[str, str, int], whole: bool) -> None:
        finish(self._pool, conn, resp, where, whole)


class PresignedObjects:
    """Whole small objects of one bucket (a shared store's blobs and claims), read and written
    through presigned URLs: a GET of an object's head (``limit`` bytes), a PUT, either
    conditional (``If-None-Match: *``, ``If-Match``). A PUT this way sends its body once, with
    no payload hash or checksum (the URL is signed for ``UNSIGNED-PAYLOAD``): the objects
    carry their own checksums, which every reader verifies, and TLS guards an https
    endpoint's bytes in transit. botocore's PUT hashed the body twice (SHA-256 to sign it on
    http, a CRC32 trailer) on an event loop behind fsspec's ``sync``: 3-5 ms of CPU a
    megabyte object against under 1 here (docs/benchmarks-shared.md, §3e)."""

    def __init__(self, client: Any, pool: ConnectionPool, bucket: str) -> None:
        self._client = client
        self._pool = pool
        self.bucket = bucket

    def _target(self, method: str, key: str) -> tuple[tuple[str, str, int], str]:
        return split_url(self._client.generate_presigned_url(
            method, Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=URL_EXPIRES_S))

    def get(self, key: str, limit: int) -> tuple[bytes, str] | None:
        """The object's first ``limit + 1`` bytes and its ETag; None when there is none.
        Raises ``ClientError`` (an error answer), ``UseBotocore`` or the transport's error."""
        where, target = self._target("get_object", key)
        resp, conn = send(self._pool, where, "GET", target, {"Range": f"bytes=0-{limit}"})
        whole = False
        try:
            if resp.status in (200, 206):
                body = resp.read(limit + 1)
                whole = not resp.length
                return body, resp.getheader("ETag", "")
            if resp.status == 416:  # a range of an empty object
                resp.read()
                whole = True
                return b"", resp.getheader("ETag", "")
            error = answer_error(resp, "GetObject")
            if resp.status == 404 and _code(error) in ("NoSuchKey", "404"):
                return None
            raise error
        finally:
            finish(self._pool, conn, resp, where, whole)

    def put(self, key: str, data: bytes | memoryview, *, if_none_match: bool = False,
            if_match: str = "") -> str | None:
        """Store ``data`` under ``key``; its ETag, or None when a condition failed (412; a
        409 for another conditional write under way; 404 for ``If-Match`` on an object gone).
        Raises ``ClientError`` for any other error answer (501 NotImplemented: an endpoint
        without conditional writes), ``UseBotocore`` or the transport's error."""
        where, target = self._target("put_object", key)
        headers = {"Content-Length": str(len(data))}
        if if_none_match:
            headers["If-None-Match"] = "*"
        if if_match:
            headers["If-Match"] = if_match
        resp, conn = send(self._pool, where, "PUT", target, headers, data)
        whole = False
        try:
            if resp.status == 200:
                resp.read()
                whole = True
                return resp.getheader("ETag", "")
            error = answer_error(resp, "PutObject")
            conditional = if_none_match or bool(if_match)
            if conditional and (resp.status in (409, 412) or (
                    if_match and resp.status == 404)):
                return None
            raise error
        finally:
            finish(self._pool, conn, resp, where, whole)


def _code(error: Exception) -> str:
    return getattr(error, "response", {}).get("Error", {}).get("Code", "")


def split_url(url: str) -> tuple[tuple[str, str, int], str]:
    """((scheme, host, port), request target) of a URL."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    return (scheme, parts.hostname or "", port), target


def send(pool: ConnectionPool, where: tuple[str, str, int], method: str, target: str,
         headers: dict[str, str], body: bytes | memoryview | None = None
         ) -> tuple[http.client.HTTPResponse, http.client.HTTPConnection]:
    """Send a request on a kept-alive connection to ``where`` and read the answer's head; a
    connection the server closed while idle is replaced once, at once (the request never
    reached it). The caller reads the body and ``finish``es."""
    for fresh_try in (False, True):
        conn, reused = pool.take(where)
        try:
            conn.request(method, target, body=body, headers=headers)
            if conn.sock is not None:
                conn.sock.settimeout(pool.read_timeout)
            return conn.getresponse(), conn
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            conn.close()
            if reused and not fresh_try:
                continue  # the server closed an idle kept-alive connection: a new one
            raise
        except BaseException:
            conn.close()
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def finish(pool: ConnectionPool, conn: http.client.HTTPConnection,
           resp: http.client.HTTPResponse, where: tuple[str, str, int], whole: bool) -> None:
    """The connection back to the pool after a whole answer, else closed."""
    if whole and resp.isclosed() and not resp.will_close:
        pool.give(where, conn)
    else:  # the response first: its file holds the socket open (a body cut by a
        # timeout left it so until a garbage collection, and "unclosed socket")
        resp.close()
        conn.close()


def answer_error(resp: http.client.HTTPResponse, operation: str) -> Exception:
    """An error answer as botocore would raise it (``ClientError`` with the status and the S3
    error code of the body), or ``UseBotocore`` for a redirect."""
    from botocore.exceptions import ClientError

    try:
        body = resp.read(ERROR_BODY_LIMIT).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        body = ""
    code = _xml_field(body, "Code") or str(resp.status)
    if resp.status in (301, 302, 307) or code in REDIRECT_CODES:
        return UseBotocore(f"{code} (HTTP {resp.status})")
    error = {"Code": code, "Message": _xml_field(body, "Message")}
    return ClientError({"Error": error, "ResponseMetadata": {"HTTPStatusCode": resp.status}},
                       operation)


def _xml_field(body: str, name: str) -> str:
    m = re.search(rf"<{name}>([^<]*)</{name}>", body)
    return m.group(1) if m else ""
