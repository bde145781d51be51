"""Name rules for tags and blobs: what a directory entry of the mount may be called.

A valid name is 1..255 bytes of valid UTF-8 with no '/', NUL or other control character (a
newline would break every listing and log line), not '.' or '..'. Tag names may not start with '.' (the root keeps ``.faultfs``); a user
blob's may, except the names the tree itself uses: ``.pagemap`` and anything starting with
``.faultfs`` (the mount's own hidden names, ``HIDDEN_PREFIX``).
"""

from __future__ import annotations

import errno

from faultfs.errors import InvalidInput

MAX_NAME_BYTES = 255  # NAME_MAX of every Linux file system
# The entries the mount keeps for itself (DESIGN §7): spelled here once.
CTL_NAME = ".faultfs"  # the control directory at the root: stats, registry
PAGEMAP_NAME = ".pagemap"  # a tag's pagemap text
PAGE_PREFIX = "page:"  # page N of a tag is "page:N"
# a user blob named so is the mount's own (an unlinked one still open): never listed nor found
HIDDEN_PREFIX = ".faultfs"
# Extended attributes of a tag's files (mounts with --xattrs): "1"/"0" for a chunk, "here/total"
# chunks for a view (here: staged, dirty or grown; total: with the chunks the view grew).
XATTR_STAGED = "user.faultfs.staged"
XATTR_TAG = "user.faultfs.tag"
XATTR_SOURCE = "user.faultfs.source"
MAX_INDEX_DIGITS = 12  # a blob index fits 36 bits (core.inodes): 12 decimal digits at most


def parse_index(digits: str) -> int | None:
    """The index a canonical decimal string names (``"7"``, not ``"07"``, ``"+7"`` or ``"٧"``),
    else None."""
    if not digits or len(digits) > MAX_INDEX_DIGITS or not digits.isascii() or not digits.isdigit():
        return None
    if len(digits) > 1 and digits[0] == "0":
        return None
    return int(digits)


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot name anything of faultfs (not UTF-8, a control character), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (faultfs keeps names as UTF-8: rename it, or link it under a UTF-8 name)"
    if "\x00" in text:
        return "contains NUL"
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        return "contains a control character"
    return None


def check_name(name: str, what: str = "name", *, allow_dot: bool = False) -> str:
    """Return ``name`` if it is a valid entry name, else raise InvalidInput saying why."""
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"{what} must not be empty")
    problem = text_problem(name)
    if problem is not None:
        raise InvalidInput(f"{what} {name!r} {problem}")
    raw = name.encode("utf-8")
    if len(raw) > MAX_NAME_BYTES:
        raise InvalidInput(f"{what} {name[:40]!r}... is {len(raw)} bytes, over {MAX_NAME_BYTES}",
                           errno.ENAMETOOLONG)
    if "/" in name:
        raise InvalidInput(f"{what} {name!r} contains '/'")
    if "\x00" in name:
        raise InvalidInput(f"{what} {name!r} contains NUL")
    if name in (".", ".."):
        raise InvalidInput(f"{what} {name!r} is not allowed")
    if not allow_dot and name.startswith("."):
        raise InvalidInput(f"{what} {name!r} starts with '.', which faultfs keeps for itself")
    return name


def is_hidden(name: str) -> bool:
    """Whether ``name`` is one the mount keeps for itself inside a tag (never a user's)."""
    return name.startswith(HIDDEN_PREFIX)


def check_tag_name(name: str) -> str:
    """A tag name picked by a user: a valid name that also contains no '..' run."""
    check_name(name, "tag name")
    if ".." in name:
        raise InvalidInput(f"tag name {name!r} contains '..'")
    if name.startswith(PAGE_PREFIX):
        raise InvalidInput(f"tag name {name!r} starts with {PAGE_PREFIX!r}, which names pages")
    return name


def check_blob_prefix(prefix: str) -> str:
    """A chunk-name prefix (may be empty): its names must be valid names that are not pages
    or hidden entries of a tag directory."""
    if "/" in prefix:
        raise InvalidInput(f"blob prefix {prefix!r} contains '/'")
    problem = text_problem(prefix)
    if problem is not None:
        raise InvalidInput(f"blob prefix {prefix!r} {problem}")
    if prefix.startswith(PAGE_PREFIX) or prefix.startswith("."):
        raise InvalidInput(f"blob prefix {prefix!r} would name chunks like pages or hidden "
                           f"entries (it must not start with {PAGE_PREFIX!r} or '.')")
    return prefix
