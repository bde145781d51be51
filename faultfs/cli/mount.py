"""``faultfs mount SRC... MNT``: register sources (or remount a store) and serve them.

By default it starts the daemon and returns only once the mount answers, or says why it
failed. The daemon gets its arguments on stdin, not on its command line: a source URL may
carry credentials, and /proc/PID/cmdline is readable by every local user.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from faultfs.cli.common import EXIT_ERROR, mode_arg, owner_arg, range_arg, size_arg
from faultfs.config import Config
from faultfs.core.ownership import Ownership
from faultfs.errors import FaultfsError

log = logging.getLogger("faultfs")

ARGV_STDIN = "--argv-on-stdin"  # how `faultfs mount` hands its arguments to the daemon
READY_TIMEOUT_S = 300.0  # registering many remote shards can take a while
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def register(sub) -> None:
    m = sub.add_parser("mount", help="mount sources (or remount a store) at MNT",
                       description="Mount SRC... at MNT. With no SRC, remount every tag the "
                                   "store has registered.")
    m.add_argument("paths", nargs="+", metavar="SRC... MNT",
                   help="sources (paths, file::/p, file:///p, s3://b/k, fsspec URLs, globs) then the mountpoint")
    m.add_argument("--tag", help="tag name (one source only; default: the source's stem)")
    m.add_argument("--chunk-size", type=size_arg("chunk size"), default=0,
                   help="bytes per chunk blob: 4M, 1MiB, 1048576 (0: the assimilator's default, 1 MiB)")
    m.add_argument("--blob-prefix", default="chunk_", help="blob name prefix (default chunk_; may be empty)")
    m.add_argument("--range", type=range_arg, metavar="OFF:SIZE",
                   help="ingest only this byte range of the source (SIZE 0: to the end)")
    m.add_argument("--format", default="binary", help="assimilator (default: binary)")
    m.add_argument("--page-size", type=size_arg("page size"), default=0,
                   help="write an identity pagemap with pages of this size")
    m.add_argument("--store", metavar="DIR", help="store directory (default $XDG_CACHE_HOME/faultfs)")
    m.add_argument("--reserve-mb", type=int, help="keep this much free on the store's file system (default 512)")
    m.add_argument("--cache-size", type=size_arg("cache size"),
                   help="cap the store at this many bytes, evicting least-recently-used clean blobs")
    m.add_argument("--no-store", action="store_true",
                   help="never store: pure read-through (writes are refused)")
    m.add_argument("--read-only", action="store_true", help="refuse every write (EROFS)")
    m.add_argument("--xattrs", action="store_true",
                   help="answer the user.faultfs.* extended attributes (the kernel then asks one "
                        "before every write: a small write costs two requests)")
    m.add_argument("--dirty-mb", type=int,
                   help="written bytes held in memory; past it they are read back from the "
                        "journal (default 64)")
    m.add_argument("--journal-mb", type=int,
                   help="journal bytes on disk before a checkpoint folds the writes into "
                        "files (default 1024)")
    m.add_argument("--shared-store", metavar="URL",
                   help="share registrations and clean blobs with every node mounting the same "
                        "object store (s3://bucket/prefix, a directory, any fsspec URL; "
                        "default $FAULTFS_SHARED_STORE)")
    m.add_argument("--shared-store-endpoint-url", metavar="URL",
                   help="the shared store's S3 endpoint, when it is not the sources'")
    m.add_argument("--shared-store-key", metavar="FILE",
                   help="the cluster key (a file of 32 or more secret bytes): objects of the "
                        "shared store are sealed with it, and only objects whose seal verifies "
                        "are used (default $FAULTFS_SHARED_STORE_KEY)")
    m.add_argument("--no-shared-claims", action="store_true",
                   help="do not claim blobs in the shared store before fetching them: nodes "
                        "that miss one at the same moment each read it from the source")
    m.add_argument("--metrics-addr", metavar="HOST:PORT",
                   help="serve Prometheus metrics over HTTP here (a bare PORT: loopback)")
    m.add_argument("--io-threads", type=int, help="size of the I/O pool for blocking reads (default 32)")
    m.add_argument("--stats", action="store_true", help="log the counters every 5 s")
    m.add_argument("--memory-mb", type=int, help="recently faulted blobs kept in memory (default 64)")
    m.add_argument("--prefetch-mb", type=int, help="memory a sequential reader's window of faults ahead holds (default 32, within half of --memory-mb; from S3 it reaches twice as far; 0: off)")
    m.add_argument("--readahead-kb", type=int, help="kernel readahead of the mount (default 4096; 0: kernel default)")
    m.add_argument("--max-background", type=int,
                   help="the kernel's background requests (readahead) in flight on the mount "
                        "(default 64; 0: the kernel's 12)")
    m.add_argument("--inline-read-kb", type=int,
                   help="staged reads up to this size are read on the serving thread, not the I/O pool "
                        "(default 64; 0: always the pool, e.g. for a store on a network disk)")
    m.add_argument("--s3-endpoint-url", default="", help="S3 endpoint (default: AWS configuration)")
    m.add_argument("--s3-region", default="", help="S3 region")
    m.add_argument("--s3-profile", default="", help="AWS profile for S3 credentials")
    m.add_argument("--anon", action="store_true", help="read remote sources anonymously")
    m.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    m.add_argument("--uid", type=owner_arg("uid"),
                   help="owner of every entry: a user id or name (default: the daemon's user)")
    m.add_argument("--gid", type=owner_arg("gid"),
                   help="group of every entry: a group id or name (default: the daemon's group)")
    m.add_argument("--file-mode", type=mode_arg("file mode"), metavar="OCTAL",
                   help="permission bits of files (write bits dropped where a file cannot be "
                        "written; default 0644, 0444 read-only)")
    m.add_argument("--dir-mode", type=mode_arg("dir mode"), metavar="OCTAL",
                   help="permission bits of directories (default 0755)")
    m.add_argument("--umask", type=mode_arg("umask"), metavar="OCTAL",
                   help="files 0666 and directories 0777 less these bits (the modes above win)")
    m.add_argument("--foreground", "-f", action="store_true", help="stay in the foreground")
    m.add_argument("--debug", action="store_true", help="debug logging and tracebacks")
    m.add_argument("--no-holder", action="store_true",
                   help="no holder process: a crash of the daemon ends the mount (ENOTCONN) "
                        "instead of a new daemon taking it over")
    m.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    # set by the holder (fuse/holder.py) on the daemons it starts
    m.add_argument("--holder-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--state-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--takeover-fd", type=int, help=argparse.SUPPRESS)
    m.add_argument("--standby", action="store_true", help=argparse.SUPPRESS)
    m.set_defaults(func=cmd_mount)


def cmd_mount(args: argparse.Namespace) -> int:
    if args.foreground or args.ready_fd is not None or args.holder_fd is not None:
        return _mount_here(args)
    return _mount_daemon(args)


def _daemon_command() -> list[str]:
    return [sys.executable, "-m", "faultfs.cli", ARGV_STDIN]


def _start(args: argparse.Namespace, write_fd: int, early) -> subprocess.Popen:
    """Start the daemon, or the holder that starts it and keeps its mount across daemon
    crashes and restarts (fuse/holder.py)."""
    from faultfs.fuse.daemons import run_dir

    if args.no_holder:
        cmd, request = _daemon_command(), [*args.argv, "--ready-fd", str(write_fd)]
    else:
        cmd = [sys.executable, "-m", "faultfs.fuse.holder"]
        request = {"command": _daemon_command(), "argv": args.argv, "ready_fd": write_fd,
                   "run_dir": run_dir()}
    proc = subprocess.Popen(
        cmd, pass_fds=(write_fd,), start_new_session=True, stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL, stderr=early)
    assert proc.stdin is not None
    try:
        proc.stdin.write(json.dumps(request).encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at once; _read_ready reports it
    return proc


def _mount_daemon(args: argparse.Namespace) -> int:
    """Start the daemon and wait until it says the mount answers (or why it failed).

    Nothing is written to the store here: until the daemon has validated the request and
    opened the store's log, its stderr goes to a private temporary file, shown if it dies
    without a word and removed after."""
    read_fd, write_fd = os.pipe()
    early = tempfile.TemporaryFile(prefix="faultfs-mount-")  # 0600, unlinked already
    # The arguments travel on the daemon's stdin, not its command line: a source URL may
    # carry credentials (a presigned query, user:password@), and /proc/PID/cmdline is
    # readable by every local user for as long as the daemon runs.
    proc = _start(args, write_fd, early)
    os.close(write_fd)
    message = _read_ready(read_fd, proc)
    os.close(read_fd)
    try:
        if message.startswith("ok"):
            info = json.loads(message[2:] or "{}")
            tags = ", ".join(info.get("tags", []))
            pid = info.get("pid", proc.pid)
            held = "" if args.no_holder else f", holder pid {proc.pid}"
            print(f"mounted {info.get('mountpoint', '')} (tags: {tags}; pid {pid}{held})")
            for note in info.get("notes", []):
                print(f"faultfs: {note}")
            for warning in info.get("warnings", []):
                print(f"faultfs: warning: {warning}", file=sys.stderr)
            return 0
        if message.startswith("error "):
            print(f"faultfs: {message[6:]}", file=sys.stderr)
        else:
            early.seek(0)
            said = early.read()[-2000:].decode(errors="replace").strip()
            print(f"faultfs: the daemon exited before the mount was ready (exit code "
                  f"{proc.poll()})" + (f":\n{said}" if said else ""), file=sys.stderr)
        return EXIT_ERROR
    finally:
        early.close()


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


def _setup_logging(args: argparse.Namespace) -> None:
    """Log to stderr; the daemon moves its log into the store once the store is ready
    (``daemon.log_to_store``)."""
    level = logging.DEBUG if args.debug else logging.INFO
    root = logging.getLogger()
    root.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    if not args.debug:
        for noisy in ("botocore", "s3fs", "fsspec", "aiobotocore", "urllib3", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def _mount_here(args: argparse.Namespace) -> int:
    """Register, recover and serve in this process (the daemon, or --foreground)."""
    from faultfs import daemon
    from faultfs.sources import SourceOptions

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

    def ready(tags: list[str], mountpoint: str, warnings: list[str],
              notes: list[str] | None = None) -> None:
        report("ok" + json.dumps({"mountpoint": mountpoint, "tags": tags, "warnings": warnings,
                                  "notes": notes or [], "pid": os.getpid()}))

    try:
        config = Config.build(store_dir=args.store, reserve_mb=args.reserve_mb,
                              store_enabled=False if args.no_store else None,
                              io_threads=args.io_threads, stats_log=True if args.stats else None,
                              cache_size=args.cache_size, memory_mb=args.memory_mb,
                              prefetch_mb=args.prefetch_mb, readahead_kb=args.readahead_kb,
                              max_background=args.max_background,
                              inline_read_kb=args.inline_read_kb,
                              read_only=True if args.read_only else None,
                              xattrs=True if args.xattrs else None,
                              dirty_mb=args.dirty_mb, journal_mb=args.journal_mb,
                              shared_store=args.shared_store,
                              shared_store_endpoint_url=args.shared_store_endpoint_url,
                              shared_store_key=(os.path.abspath(args.shared_store_key)
                                                if args.shared_store_key else None),
                              shared_claims=False if args.no_shared_claims else None,
                              metrics_addr=args.metrics_addr)
        _setup_logging(args)
        options = SourceOptions(s3_region=args.s3_region, s3_profile=args.s3_profile,
                                s3_endpoint_url=args.s3_endpoint_url, anon=args.anon,
                                local_direct=config.source_direct)
        *sources, mountpoint = args.paths
        range_off, range_size = args.range or (0, 0)
        spec = daemon.MountSpec(
            sources=tuple(sources), mountpoint=mountpoint, tag=args.tag,
            chunk_size=args.chunk_size, blob_prefix=args.blob_prefix, range_off=range_off,
            range_size=range_size, format=args.format, page_size=args.page_size,
            allow_other=args.allow_other, ownership=ownership_of(args))
        held = None
        if args.holder_fd is not None:
            from faultfs.fuse.handover import Handover

            held = Handover.from_fds(args.holder_fd, args.state_fd, args.takeover_fd,
                                     standby=args.standby)
        daemon.run(spec, config, options, ready=ready,
                   log_to_store=args.ready_fd is not None or held is not None, held=held)
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
    return 0


def ownership_of(args: argparse.Namespace) -> Ownership | None:
    """The owner and modes of every entry the flags ask for; None: the defaults."""
    if (args.uid, args.gid, args.file_mode, args.dir_mode, args.umask) == (None,) * 5:
        return None
    uid = os.getuid() if args.uid is None else args.uid
    gid = os.getgid() if args.gid is None else args.gid
    if args.umask is not None:
        return Ownership.with_umask(uid, gid, args.umask, file_mode=args.file_mode,
                                    dir_mode=args.dir_mode)
    return Ownership(uid, gid, args.file_mode, args.dir_mode)
