"""What every subcommand shares: the one-line argument parser, size and range arguments,
exit codes."""

from __future__ import annotations

import argparse

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


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (``faultfs: ...``), like every other error."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(EXIT_USAGE, f"faultfs: {message} (see {self.prog} --help)\n")
