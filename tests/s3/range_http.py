"""A local HTTP/1.1 server for mount tests: objects by path, 206 ranges, ETag and If-Match.

It can also stand in for the two ways a URL carries credentials: ``require_basic`` makes it
answer 401 without that ``Authorization: Basic`` pair (userinfo in the URL), and
``require_query`` makes it answer 403 to any request that lacks those query parameters, and to
every HEAD (like S3, whose presigned GET URL is not valid for HEAD).
"""

from __future__ import annotations

import base64
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit


class RangeHttpServer:
    """Serves ``objects[path] = (bytes, etag)``; each ``put`` makes a new ETag ``"vN"``."""

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, str]] = {}
        self.require_basic: tuple[str, str] | None = None
        self.require_query: dict[str, str] = {}
        self.range_gets = 0
        self._versions = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

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
                if not self._authorised():
                    return
                path = urlsplit(self.path).path
                if path not in server.objects:
                    return self._reply(404, {}, b"no such thing")
                data, etag = server.objects[path]
                headers = {"ETag": etag, "Accept-Ranges": "bytes"}
                if_match = self.headers.get("If-Match")
                if if_match and if_match != etag:
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

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def put(self, path: str, data: bytes) -> str:
        """Store ``data`` at ``path`` as a new version; its URL."""
        with self._lock:
            self._versions += 1
            self.objects[path] = (data, f'"v{self._versions}"')
        return f"{self.base}{path}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
