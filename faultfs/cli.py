"""The ``faultfs`` command: mount, umount, stat (plus pagemap, warm, checkpoint).

Errors print one line (no traceback unless ``--debug``) and exit non-zero. ``faultfs mount``
daemonizes by default and returns only once the mount answers, or says why it failed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from faultfs import __version__
from faultfs.core.units import format_size, parse_size
from faultfs.errors import FaultfsError, InvalidInput

log = logging.getLogger("faultfs")

ARGV_STDIN = "--argv-on-stdin"  # how `faultfs mount` hands its arguments to the daemon
READY_TIMEOUT_S = 300.0  # registering many remote shards can take a while
EXIT_ERROR = 1
EXIT_USAGE = 2


def _size_arg(what: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, what)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def _range_arg(text: str) -> tuple[int, int]:
    off, sep, size = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"range {text!r} is not OFF:SIZE (e.g. 1M:64M, 0:0)")
    try:
        return parse_size(off, "range offset"), parse_size(size or "0", "range size")
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (``faultfs: ...``), like every other error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"faultfs: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="faultfs",
        description="Mount big, slow or remote data; copy nothing until a byte is touched.")
    parser.add_argument("--version", action="version", version=f"faultfs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    m = sub.add_parser("mount", help="mount sources (or remount a store) at MNT",
                       description="Mount SRC... at MNT. With no SRC, remount every tag the "
                                   "store has registered.")
    m.add_argument("paths", nargs="+", metavar="SRC... MNT",
                   help="sources (paths, file::/p, file:///p, s3://b/k, fsspec URLs, globs) then the mountpoint")
    m.add_argument("--tag", help="tag name (one source only; default: the source's stem)")
    m.add_argument("--chunk-size", type=_size_arg("chunk size"), default=0,
                   help="bytes per chunk blob: 4M, 1MiB, 1048576 (0: the assimilator's default, 1 MiB)")
    m.add_argument("--blob-prefix", default="chunk_", help="blob name prefix (default chunk_; may be empty)")
    m.add_argument("--range", type=_range_arg, metavar="OFF:SIZE",
                   help="ingest only this byte range of the source (SIZE 0: to the end)")
    m.add_argument("--format", default="binary", help="assimilator (default: binary)")
    m.add_argument("--page-size", type=_size_arg("page size"), default=0,
                   help="write an identity pagemap with pages of this size")
    m.add_argument("--store", metavar="DIR", help="store directory (default $XDG_CACHE_HOME/faultfs)")
    m.add_argument("--reserve-mb", type=int, help="keep this much free on the store's file system (default 512)")
    m.add_argument("--cache-size", type=_size_arg("cache size"),
                   help="cap the store at this many bytes, evicting least-recently-used clean blobs")
    m.add_argument("--no-store", action="store_true", help="never store: pure read-through")
    m.add_argument("--io-threads", type=int, help="size of the I/O pool for blocking reads (default 32)")
    m.add_argument("--stats", action="store_true", help="log the counters every 5 s")
    m.add_argument("--memory-mb", type=int, help="recently faulted blobs kept in memory (default 64)")
    m.add_argument("--prefetch-mb", type=int, help="fault up to this much ahead of sequential readers (default 32; 0: off)")
    m.add_argument("--readahead-kb", type=int, help="kernel readahead of the mount (default 4096; 0: kernel default)")
    m.add_argument("--inline-read-kb", type=int,
                   help="staged reads up to this size are read on the serving thread, not the I/O pool "
                        "(default 64; 0: always the pool, e.g. for a store on a network disk)")
    m.add_argument("--s3-endpoint-url", default="", help="S3 endpoint (default: AWS configuration)")
    m.add_argument("--s3-region", default="", help="S3 region")
    m.add_argument("--s3-profile", default="", help="AWS profile for S3 credentials")
    m.add_argument("--anon", action="store_true", help="read remote sources anonymously")
    m.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground")
    m.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)

    u = sub.add_parser("umount", help="unmount MNT and wait for its daemon")
    u.add_argument("mountpoint")
    u.add_argument("--debug", action="store_true")
    u.set_defaults(func=cmd_umount)

    s = sub.add_parser("stat", help="show a mount's counters")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.add_argument("--debug", action="store_true")
    s.set_defaults(func=cmd_stat)

    for module in ("faultfs.pagemap_cli", "faultfs.cursor_cli"):
        try:
            mod = __import__(module, fromlist=["register"])
        except ImportError:
            continue
        mod.register(sub)
    return parser


# -- mount ----------------------------------------------------------------------------------

def cmd_mount(args: argparse.Namespace) -> int:
    if args.foreground or args.ready_fd is not None:
        return _mount_here(args)
    return _mount_daemon(args)


def _mount_daemon(args: argparse.Namespace) -> int:
    """Start the daemon and wait until it says the mount answers (or why it failed)."""
    from faultfs.config import default_store_dir

    read_fd, write_fd = os.pipe()
    store = os.path.abspath(os.path.expanduser(args.store or default_store_dir()))
    log_path = os.path.join(store, "log", "faultfs.log")
    try:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log_file = open(log_path, "ab")
    except OSError:
        log_file = None
    # The arguments travel on the daemon's stdin, not its command line: a source URL may
    # carry credentials (a presigned query, user:password@), and /proc/PID/cmdline is
    # readable by every local user for as long as the daemon runs.
    cmd = [sys.executable, "-m", "faultfs.cli", ARGV_STDIN]
    proc = subprocess.Popen(
        cmd, pass_fds=(write_fd,), start_new_session=True, stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=log_file or subprocess.DEVNULL)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps([*args.argv, "--ready-fd", str(write_fd)]).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the daemon died at once; _read_ready reports it
    os.close(write_fd)
    if log_file is not None:
        log_file.close()
    message = _read_ready(read_fd, proc)
    os.close(read_fd)
    if message.startswith("ok"):
        info = json.loads(message[2:] or "{}")
        tags = ", ".join(info.get("tags", []))
        print(f"mounted {info.get('mountpoint', '')} (tags: {tags}; pid {proc.pid})")
        return 0
    if message.startswith("error "):
        print(f"faultfs: {message[6:]}", file=sys.stderr)
    else:
        code = proc.poll()
        print(f"faultfs: the daemon exited before the mount was ready (exit code {code}); "
              f"see {log_path}", file=sys.stderr)
    return EXIT_ERROR


def _read_ready(fd: int, proc: subprocess.Popen) -> str:
    data = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    import select

    while time.monotonic() < deadline:
        readable, _, _ = select.select([fd], [], [], 0.2)
        if readable:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
            if b"\n" in data:
                break
        elif proc.poll() is not None and not data:
            # the child is gone; drain what it may have written
            readable, _, _ = select.select([fd], [], [], 0)
            if not readable:
                break
    return data.decode(errors="replace").strip()


def _setup_logging(args: argparse.Namespace, store_dir: str | None) -> None:
    level = logging.DEBUG if args.debug else logging.INFO
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    root = logging.getLogger()
    root.handlers.clear()
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if args.ready_fd is not None and store_dir is not None:
        try:
            os.makedirs(os.path.join(store_dir, "log"), exist_ok=True)
            handler = logging.FileHandler(os.path.join(store_dir, "log", "faultfs.log"))
        except OSError:
            pass  # the store itself will say why it is unusable
    handler.setFormatter(logging.Formatter(fmt))
    root.addHandler(handler)
    root.setLevel(level)
    if not args.debug:
        for noisy in ("botocore", "s3fs", "fsspec", "aiobotocore", "urllib3", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _mount_here(args: argparse.Namespace) -> int:
    """Register, recover and serve in this process (the daemon, or --foreground)."""
    from faultfs.assimilators.sources import SourceOptions
    from faultfs.config import Config

    ready_fd = args.ready_fd

    def report(line: str) -> None:
        nonlocal ready_fd
        if ready_fd is not None:
            try:
                os.write(ready_fd, (line + "\n").encode())
                os.close(ready_fd)
            except OSError:
                pass
            ready_fd = None

    try:
        config = Config.build(store_dir=args.store, reserve_mb=args.reserve_mb,
                              store_enabled=False if args.no_store else None,
                              io_threads=args.io_threads, stats_log=True if args.stats else None,
                              cache_size=args.cache_size, memory_mb=args.memory_mb,
                              prefetch_mb=args.prefetch_mb, readahead_kb=args.readahead_kb,
                              inline_read_kb=args.inline_read_kb)
        _setup_logging(args, config.store_dir)
        options = SourceOptions(s3_region=args.s3_region, s3_profile=args.s3_profile,
                                s3_endpoint_url=args.s3_endpoint_url, anon=args.anon)
        engine, mountpoint = prepare_engine(args, config, options)
    except FaultfsError as exc:
        if args.debug:
            log.exception("mount failed")
        report(f"error {exc}")
        if args.ready_fd is None:
            raise
        return EXIT_ERROR
    except BaseException as exc:
        log.exception("mount failed")
        report(f"error unexpected failure: {exc!r}")
        if args.ready_fd is None:
            raise
        return EXIT_ERROR
    from faultfs.mount import serve

    info = {"mountpoint": mountpoint, "tags": sorted(engine.tags)}
    try:
        serve(engine, mountpoint, ready=lambda: report("ok" + json.dumps(info)),
              allow_other=args.allow_other, debug_fuse=False)
    except FaultfsError as exc:
        report(f"error {exc}")
        if args.ready_fd is None:
            raise
        return EXIT_ERROR
    finally:
        engine.store.release()
    log.info("unmounted %s", mountpoint)
    return 0


def prepare_engine(args: argparse.Namespace, config, options):
    """Everything a mount needs before it answers: store, lock, tags. Nothing is persisted
    until every source has been checked."""
    from faultfs.assimilators.sources import expand_sources
    from faultfs.core.context import FaultContext
    from faultfs.core.names import check_tag_name
    from faultfs.engine import Engine, default_tag_name
    from faultfs.mount import prepare_mountpoint
    from faultfs.store.blobstore import BlobStore

    *sources, mountpoint = args.paths
    if args.tag is not None:
        check_tag_name(args.tag)
    if args.chunk_size < 0 or args.chunk_size > 1 << 30:
        raise InvalidInput(f"chunk size {args.chunk_size} is not in [0, 1 GiB]")
    from faultfs.core.pagemap import MAX_PAGE_SIZE

    if args.page_size > MAX_PAGE_SIZE:
        raise InvalidInput(f"page size {args.page_size} is over the 1 GiB limit")
    store = BlobStore(config.store_dir)
    store.acquire()
    try:
        mountpoint = prepare_mountpoint(mountpoint)
        engine = Engine(store, config, options)
        urls = expand_sources(sources, options) if sources else []
        if args.tag is not None and len(urls) > 1:
            raise InvalidInput(f"--tag names one tag, but {len(urls)} sources were given")
        range_off, range_size = args.range or (0, 0)
        contexts = []
        used: set[str] = set()
        for url in urls:
            name = args.tag or _unique(default_tag_name(url), used)
            used.add(name)
            contexts.append(FaultContext(
                src=url, dst=name, format=args.format, s3_region=args.s3_region,
                s3_profile=args.s3_profile, blob_prefix=args.blob_prefix, range_off=range_off,
                range_size=range_size, chunk_size=args.chunk_size, on_fault=True))
        plans = [engine.plan(ctx) for ctx in contexts]  # validates every source first
        # A URL with credentials in it (userinfo, a presigned query) was opened as given; the
        # context that is persisted and hashed names it with those values as *** (the registry
        # never holds a secret). The real URL lives only in the opened source, in memory: a
        # remount without the source cannot re-open it (docs/sources.md, "Secrets").
        for shard, plan in enumerate(plans):
            engine.commit_plan(plan, shard=shard)
        engine.recover()
        if not engine.tags:
            raise InvalidInput(f"store {store.root} has no registered tags: give a source to mount")
        if args.page_size:
            for plan in plans:
                engine.write_identity_pagemap(engine.tags[plan.ctx.dst], args.page_size)
    except BaseException:
        store.release()
        raise
    return engine, mountpoint


def _unique(name: str, used: set[str]) -> str:
    if name not in used:
        return name
    n = 2
    while f"{name}-{n}" in used:
        n += 1
    return f"{name}-{n}"


# -- umount, stat ---------------------------------------------------------------------------

def cmd_umount(args: argparse.Namespace) -> int:
    from faultfs.mount import unmount

    unmount(args.mountpoint)
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    from faultfs.mount import read_stats

    snap = read_stats(args.mountpoint)
    if args.json:
        print(json.dumps(snap, indent=1, sort_keys=True))
        return 0
    print(render_stats(snap))
    return 0


def _memory_line(snap: dict) -> str:
    buffers = snap.get("read_buffers", {})
    return (f"memory         blobs held {format_size(snap.get('memory_bytes', 0))}; read buffers "
            f"{buffers.get('mapped', 0)} mapped, {buffers.get('reused', 0)} reuses, "
            f"{buffers.get('lent', 0)} in use, {format_size(buffers.get('free_bytes', 0))} free")


def render_stats(snap: dict) -> str:
    """The counters of ``faultfs stat`` as a readable table."""
    c = snap.get("counters", {})
    lat = snap.get("fault_latency", {})
    lines = [
        f"store          {snap.get('store')}  (free {format_size(snap.get('store_free_bytes', 0))}, "
        f"reserve {format_size(snap.get('reserve_bytes', 0))}"
        + (f", cap {format_size(snap['cache_size'])}" if snap.get("cache_size") else "")
        + ("" if snap.get("store_enabled", True) else ", storing OFF (read-through)") + ")",
        f"daemon         pid {snap.get('pid')}, up {snap.get('uptime_s', 0):.0f} s, "
        f"{snap.get('io_threads')} I/O threads",
        _memory_line(snap),
        "",
        f"{'reads':<22}{c.get('reads', 0):>12}    {'bytes served':<22}{format_size(c.get('bytes_served', 0)):>12}",
        f"{'hits':<22}{c.get('hits', 0):>12}    {'faults':<22}{c.get('faults', 0):>12}",
        f"{'source reads':<22}{c.get('source_reads', 0):>12}    {'bytes from source':<22}{format_size(c.get('source_bytes', 0)):>12}",
        f"{'stored':<22}{c.get('stored', 0):>12}    {'bytes stored':<22}{format_size(c.get('stored_bytes', 0)):>12}",
        f"{'skipped (reserve)':<22}{c.get('skipped_reserve', 0):>12}    {'skipped (no-store)':<22}{c.get('skipped_no_store', 0):>12}",
        f"{'skipped (cache cap)':<22}{c.get('skipped_cache_cap', 0):>12}    {'evicted':<22}{c.get('evicted', 0):>12}",
        f"{'store failures':<22}{c.get('store_failures', 0):>12}    {'read-through (backoff)':<22}{c.get('readthrough_backoff', 0):>12}",
        f"{'fault errors':<22}{c.get('fault_errors', 0):>12}    {'single-flight joins':<22}{c.get('single_flight_joins', 0):>12}",
        f"{'page reads':<22}{c.get('page_reads', 0):>12}    {'page slices':<22}{c.get('page_slices', 0):>12}",
        f"{'zero-filled bytes':<22}{c.get('zero_filled_bytes', 0):>12}    {'stale blobs dropped':<22}{c.get('stale_blobs_dropped', 0):>12}",
        f"{'memory hits':<22}{c.get('memory_hits', 0):>12}    {'read ahead (store)':<22}{c.get('store_readahead', 0):>12}",
        f"fault latency  p50 {lat.get('p50_ms', 0)} ms, p90 {lat.get('p90_ms', 0)} ms, "
        f"p99 {lat.get('p99_ms', 0)} ms, max {lat.get('max_ms', 0)} ms",
        "",
        f"{'tag':<20} {'blobs':>9} {'staged':>9} {'chunk':>10} {'size':>11}  source",
    ]
    for name, t in sorted(snap.get("tags", {}).items()):
        lines.append(f"{name:<20} {t['blobs']:>9} {t['staged_blobs']:>9} "
                     f"{format_size(t['chunk_size']):>10} {format_size(t['size']):>11}  {t['source']}")
        if t.get("stale_dropped_at_mount") or t.get("source_changed_at_mount"):
            lines.append(f"  source changed since the last mount: {t.get('stale_dropped_at_mount', 0)} "
                         "stale blobs dropped, re-faulting from the new version")
        if t.get("source_error"):
            lines.append(f"  source unavailable: {t['source_error']}")
    return "\n".join(lines)


# -- entry point ----------------------------------------------------------------------------

def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, letting ``mount`` take options between its sources and its mountpoint."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        stray = [a for a in extra if a.startswith("-")]
        if getattr(args, "command", None) != "mount" or stray:
            parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
        args.paths = [*args.paths, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == [ARGV_STDIN]:  # a daemon started by `faultfs mount`: arguments on stdin
        argv = json.loads(sys.stdin.buffer.read())
        sys.stdin.close()
    parser = build_parser()
    args = parse_args(parser, argv)
    args.argv = argv
    debug = getattr(args, "debug", False)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                            format="faultfs: %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except FaultfsError as exc:
        if debug:
            log.exception("failed")
        print(f"faultfs: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        if debug:
            raise
        print(f"faultfs: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
