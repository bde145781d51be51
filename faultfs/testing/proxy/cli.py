"""The proxy from a shell: ``python -m faultfs.testing.proxy --upstream HOST:PORT [options]``.

It prints the proxy's URL, serves until Ctrl-C, SIGTERM or ``--lifetime-s``, then prints a
one-line summary of what it served.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from faultfs.testing.proxy.server import LatencyProxy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m faultfs.testing.proxy",
        description="A loopback HTTP/1.1 proxy that adds a round-trip delay and a bandwidth "
                    "cap in front of a server (moto, or any HTTP/1.1 server).")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT")
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="wait before each response's first byte (default 20)")
    parser.add_argument("--conn-mbps", type=float, default=100.0,
                        help="response MB/s per client connection, 0 = uncapped (default 100)")
    parser.add_argument("--total-mbps", type=float, default=None,
                        help="response MB/s of all connections together (default uncapped)")
    parser.add_argument("--listen-host", default="127.0.0.1")
    parser.add_argument("--listen-port", type=int, default=0, help="0 = a free port (default)")
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--idle-timeout-s", type=float, default=60.0)
    parser.add_argument("--lifetime-s", type=float, default=None,
                        help="stop after this many seconds (default: run until killed)")
    args = parser.parse_args(argv)
    host, sep, port = args.upstream.removeprefix("http://").rstrip("/").rpartition(":")
    if not sep or not port.isdigit():
        parser.error("--upstream must be HOST:PORT")

    def terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM ends the run as Ctrl-C does: closed, summary printed

    signal.signal(signal.SIGTERM, terminate)
    proxy = LatencyProxy(host or "127.0.0.1", int(port), delay_ms=args.delay_ms,
                         conn_mbps=args.conn_mbps, total_mbps=args.total_mbps,
                         listen_host=args.listen_host, listen_port=args.listen_port,
                         max_connections=args.max_connections,
                         idle_timeout_s=args.idle_timeout_s, lifetime_s=args.lifetime_s)
    with proxy:
        print(proxy.url, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            proxy.wait()
        s = proxy.stats(log=False)
    print(f"served {s['served']} of {s['requests']} requests, {s['response_bytes']} bytes down, "
          f"{s['request_bytes']} up, peak {s['peak_in_flight']} in flight", file=sys.stderr)
    return 0
