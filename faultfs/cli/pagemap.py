"""`faultfs pagemap set|show`: write and inspect a tag's pagemap through its `<tag>/.pagemap` file.

Invariants:
- `set` validates the map locally with ``parse_strict`` before touching the mount: a bad map
  gets a one-line InvalidInput and nothing is written.
- `set` writes the whole text with one open/write/close; the mount replaces the map atomically
  on close and refuses a malformed one with EINVAL, which becomes a clear InvalidInput.
- `show` reports what the mount will use (the lenient ``parse``), so an unusable map shows as
  such rather than failing.
- Every failure is a FaultfsError; the main CLI prints its message and exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
from typing import Any

from faultfs.core.names import PAGEMAP_NAME
from faultfs.core.pagemap import MAX_PAGEMAP_TEXT, PageMap, parse, parse_strict
from faultfs.errors import FaultfsError, InvalidInput

PAGEMAP_FILE = PAGEMAP_NAME  # DESIGN §7: the hidden, writable pagemap file of a tag directory


def register(subparsers: Any) -> None:
    """Add `pagemap set` and `pagemap show` to the main CLI's argparse subparsers."""
    parser = subparsers.add_parser("pagemap", help="write or show a tag's pagemap")
    commands = parser.add_subparsers(dest="pagemap_command", metavar="COMMAND", required=True)

    set_parser = commands.add_parser(
        "set", help="validate FILE and install it as the pagemap of MNT/TAG"
    )
    set_parser.add_argument("tag_dir", metavar="MNT/TAG", help="tag directory in a faultfs mount")
    set_parser.add_argument("file", metavar="FILE", help="pagemap text file ('-' for stdin)")
    set_parser.add_argument("--debug", action="store_true", help="tracebacks on errors")
    set_parser.set_defaults(func=set_pagemap)

    show_parser = commands.add_parser("show", help="print the pagemap of MNT/TAG")
    show_parser.add_argument("tag_dir", metavar="MNT/TAG", help="tag directory in a faultfs mount")
    show_parser.add_argument("--raw", action="store_true", help="print the map text only")
    show_parser.add_argument("--debug", action="store_true", help="tracebacks on errors")
    show_parser.set_defaults(func=show_pagemap)


def set_pagemap(args: argparse.Namespace) -> int:
    """Validate args.file, then write it to args.tag_dir/.pagemap in one write."""
    data = _read_local(args.file)
    text = _decode(data, args.file)
    try:
        parse_strict(text)
    except InvalidInput as err:
        raise InvalidInput(f"{args.file}: {err.message}; nothing written") from None
    target = os.path.join(_tag_dir(args.tag_dir), PAGEMAP_FILE)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as err:
        raise _os_error("cannot open", target, err) from None
    try:
        view = memoryview(data)
        while view:  # one write call unless the kernel takes it in parts
            written = os.write(fd, view)
            view = view[written:]
    except OSError as err:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise _os_error("cannot write", target, err) from None
    try:
        os.close(fd)  # the mount validates and swaps the map in on close
    except OSError as err:
        raise _os_error("cannot install", target, err) from None
    return 0


def show_pagemap(args: argparse.Namespace) -> int:
    """Print a summary and the text of args.tag_dir/.pagemap (the text only with --raw)."""
    target = os.path.join(_tag_dir(args.tag_dir), PAGEMAP_FILE)
    try:
        with open(target, "rb") as f:
            data = f.read(MAX_PAGEMAP_TEXT + 1)
    except FileNotFoundError:
        raise FaultfsError(f"{args.tag_dir}: the tag has no pagemap", errno.ENOENT) from None
    except OSError as err:
        raise _os_error("cannot read", target, err) from None
    text = _decode(data, target)
    if args.raw:
        sys.stdout.write(text)
        return 0
    sys.stdout.write(summary(parse(text)))
    sys.stdout.write("\n" + text)
    return 0


def summary(pagemap: PageMap) -> str:
    """A few `key value` lines describing a map as the mount sees it."""
    if pagemap.empty:
        return "pagemap   unusable (malformed or no page_size): no pages are shown\n"
    return (
        f"page_size {pagemap.page_size}\n"
        f"total     {pagemap.total}\n"
        f"pages     {pagemap.num_pages}\n"
        f"extents   {len(pagemap.extents)}\n"
        f"blobs     {len({e.blob_name for e in pagemap.extents})}\n"
    )


def _tag_dir(path: str) -> str:
    if not os.path.isdir(path):
        raise InvalidInput(f"{path}: not a tag directory")
    return path


def _read_local(path: str) -> bytes:
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_PAGEMAP_TEXT + 1)
        else:
            with open(path, "rb") as f:
                data = f.read(MAX_PAGEMAP_TEXT + 1)
    except OSError as err:
        raise _os_error("cannot read", path, err) from None
    if len(data) > MAX_PAGEMAP_TEXT:
        raise InvalidInput(f"{path}: pagemap is over {MAX_PAGEMAP_TEXT} bytes; nothing written")
    return data


def _decode(data: bytes, where: str) -> str:
    if len(data) > MAX_PAGEMAP_TEXT:
        raise InvalidInput(f"{where}: pagemap is over {MAX_PAGEMAP_TEXT} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidInput(f"{where}: pagemap is not UTF-8 (byte {err.start})") from None


def _os_error(action: str, path: str, err: OSError) -> FaultfsError:
    code = err.errno or errno.EIO
    if code == errno.EINVAL:
        return InvalidInput(f"{path}: the mount refused the pagemap as malformed (EINVAL)")
    return FaultfsError(f"{path}: {action}: {os.strerror(code)}", code)
