"""A local HTTP/1.1 server that honours Range, HEAD and If-Match, for source and mount tests
and the torture suite's chaos case (the well-behaved origin it puts a fault-injecting
``LatencyProxy`` in front of): objects by path.

Each ``put`` makes a new version: ETag ``"vN"`` and a Last-Modified one second later. The
switches default to a well-behaved public server; each makes it misbehave or refuse one way:

- ``send_etag = False``: no ETag, so only Last-Modified (and the size) identify a version.
- ``honour_if_match = False``: a stale ``If-Match`` is ignored instead of answered with 412.
- ``fail_next = N``: the next N GETs answer 503.
- ``require_basic = (user, password)``: 401 without that ``Authorization: Basic`` pair (userinfo
  in the URL).
- ``require_query = {name: value}``: 403 to any request that lacks those query parameters, and to
  every HEAD (like S3, whose presigned GET URL is not valid for HEAD).

Counters: ``gets`` counts every GET that arrives (a 503 or a 404 too), ``range_gets`` the ranged
GETs of an existing object that passed the credential and ``If-Match`` checks.
"""

from __future__ import annotations

import base64
import re
import threading
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up (a reset a proxy made): nothing to report


class RangeHttpServer:
    """Serves ``objects[path] = (bytes, etag, last_modified)`` on 127.0.0.1, from a thread."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str, str]] = {}
        self.send_etag = True
        self.honour_if_match = True
        self.fail_next = 0
        self.require_basic: tuple[str, str] | None = None
        self.require_query: dict[str, str] = {}
        self.gets = 0
        self.range_gets = 0
        self._versions = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _authorised(self) -> bool:
                if server.require_basic is not None:
                    user, password = server.require_basic
                    token = base64.b64encode(f"{user}:{password}".encode()).decode()
                    if self.headers.get("Authorization") != f"Basic {token}":
                        self._reply(401, {"WWW-Authenticate": 'Basic realm="t"'}, b"who?")
                        return False
                if server.require_query:
                    query = dict(parse_qsl(urlsplit(self.path).query))
                    if self.command == "HEAD" or any(
                        query.get(k) != v for k, v in server.require_query.items()
                    ):
                        self._reply(403, {}, b"SignatureDoesNotMatch")
                        return False
                return True

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                if self.command == "GET":
                    with server._lock:
                        server.gets += 1
                        fail = server.fail_next > 0
                        server.fail_next -= fail
                    if fail:
                        return self._reply(503, {}, b"busy")
                if not self._authorised():
                    return
                path = urlsplit(self.path).path
                if path not in server.objects:
                    return self._reply(404, {}, b"no such thing")
                data, etag, last_modified = server.objects[path]
                headers = {"Last-Modified": last_modified, "Accept-Ranges": "bytes"}
                if server.send_etag:
                    headers["ETag"] = etag
                if_match = self.headers.get("If-Match")
                if if_match and server.honour_if_match and if_match != etag:
                    return self._reply(412, {}, b"precondition failed")
                m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if not m:
                    headers["Content-Length"] = str(len(data))
                    return self._reply(200, headers, data)
                with server._lock:
                    server.range_gets += 1
                first = int(m.group(1))
                last = min(int(m.group(2) or len(data) - 1), len(data) - 1)
                if first >= len(data):
                    return self._reply(416, {"Content-Range": f"bytes */{len(data)}"})
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                return self._reply(206, headers, data[first:last + 1])

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def put(self, path: str, data: bytes) -> str:
        """Store ``data`` at ``path`` as a new version; its URL."""
        with self._lock:
            self._versions += 1
            last_modified = formatdate(1_700_000_000 + self._versions, usegmt=True)
            self.objects[path] = (data, f'"v{self._versions}"', last_modified)
        return f"{self.base}{path}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
