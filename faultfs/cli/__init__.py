"""The ``faultfs`` command: one module per subcommand, each with ``register(subparsers)``.

Errors print one line (no traceback unless ``--debug``) and exit non-zero.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from faultfs import __version__
from faultfs.cli import (
    checkpoint,
    clone,
    export,
    forget,
    fsck,
    fstab,
    gc,
    mount,
    pagemap,
    reset,
    restart,
    stat,
    umount,
    warm,
)
from faultfs.cli.common import EXIT_ERROR, OneLineParser
from faultfs.errors import FaultfsError

log = logging.getLogger("faultfs")

SUBCOMMANDS = (mount, umount, restart, stat, reset, clone, export, forget, pagemap, warm, checkpoint,
               fsck, gc)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="faultfs",
        description="Mount big, slow or remote data; copy nothing until a byte is touched.")
    parser.add_argument("--version", action="version", version=f"faultfs {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


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
    if argv == [mount.ARGV_STDIN]:  # a daemon started by `faultfs mount`: arguments on stdin
        argv = json.loads(sys.stdin.buffer.read())
        sys.stdin.close()
    elif fstab.is_helper_call(argv):  # `mount -t fuse.faultfs`: mount.fuse runs `faultfs SRC MNT -o …`
        try:
            argv = fstab.mount_argv(argv)
        except FaultfsError as exc:
            print(f"faultfs: {exc}", file=sys.stderr)
            return EXIT_ERROR
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


def mount_helper(argv: list[str] | None = None) -> int:
    """``mount.faultfs SRC MNT -o OPTIONS`` (``mount -t faultfs``, with a link in /sbin)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        translated = fstab.mount_argv(args)
    except FaultfsError as exc:
        print(f"faultfs: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return main(translated)
