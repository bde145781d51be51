"""What every subcommand shares: the one-line argument parser, size and range arguments,
exit codes."""

from __future__ import annotations

import argparse

from faultfs.core.ownership import MAX_ID, parse_mode
from faultfs.core.units import parse_size
from faultfs.errors import InvalidInput

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2


def size_arg(what: str):
    """An argparse type for sizes: ``4M``, ``1MiB``, ``1048576``."""
    def parse(text: str) -> int:
        try:
            return parse_size(text, what)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def range_arg(text: str) -> tuple[int, int]:
    """An argparse type for ``OFF:SIZE`` byte ranges."""
    off, sep, size = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"range {text!r} is not OFF:SIZE (e.g. 1M:64M, 0:0)")
    try:
        return parse_size(off, "range offset"), parse_size(size or "0", "range size")
    except InvalidInput as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def mode_arg(what: str):
    """An argparse type for octal modes and masks: ``0640``, ``640``, ``0o640``."""
    def parse(text: str) -> int:
        try:
            return parse_mode(text, what)
        except InvalidInput as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def owner_arg(kind: str):
    """An argparse type for ``--uid`` (a number or a user name) and ``--gid`` (a number or a
    group name)."""
    def parse(text: str) -> int:
        if text.isdigit():
            value = int(text)
            if value > MAX_ID:
                raise argparse.ArgumentTypeError(f"{kind} {text} is not in [0, {MAX_ID}]")
            return value
        try:
            if kind == "uid":
                import pwd

                return pwd.getpwnam(text).pw_uid
            import grp

            return grp.getgrnam(text).gr_gid
        except KeyError:
            what = "user" if kind == "uid" else "group"
            raise argparse.ArgumentTypeError(f"{kind} {text!r} is no number and no {what} "
                                             "of this system") from None
    return parse


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (``faultfs: ...``), like every other error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"faultfs: {message} (see {self.prog} --help)\n")
