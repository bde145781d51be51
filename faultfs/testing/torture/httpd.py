"""A loopback HTTP/1.1 server of fixed objects that honours Range, HEAD and If-Match: the
well-behaved origin the chaos case puts a fault-injecting ``LatencyProxy`` in front of.

Each object has a strong ETag and a fixed Last-Modified; ``gets`` counts the GETs that arrived.
"""

from __future__ import annotations

import re
import threading
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up (a reset the proxy made): nothing to report


class RangeServer:
    """``objects[path] = bytes`` served from 127.0.0.1 on a thread of its own."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = dict(objects)
        self.gets = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _reply(self, status: int, headers: dict[str, str], body: bytes = b"") -> None:
                self.send_response(status)
                headers.setdefault("Content-Length", str(len(body)))
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                with server._lock:
                    server.gets += self.command == "GET"
                data = server.objects.get(urlsplit(self.path).path)
                if data is None:
                    return self._reply(404, {}, b"no such object")
                etag = f'"{len(data):x}-torture"'
                headers = {"ETag": etag, "Accept-Ranges": "bytes",
                           "Last-Modified": formatdate(1_700_000_000, usegmt=True)}
                match = self.headers.get("If-Match")
                if match and match != etag:
                    return self._reply(412, {}, b"precondition failed")
                m = _RANGE.fullmatch(self.headers.get("Range", ""))
                if m is None:
                    headers["Content-Length"] = str(len(data))
                    return self._reply(200, headers, data if self.command == "GET" else b"")
                first = int(m.group(1))
                last = min(int(m.group(2) or len(data) - 1), len(data) - 1)
                if first >= len(data):
                    return self._reply(416, {"Content-Range": f"bytes */{len(data)}"})
                headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
                return self._reply(206, headers, data[first:last + 1])

        self._server = _QuietServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
