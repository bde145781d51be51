"""Who owns the mounted tree and with which permission bits (``--uid``, ``--gid``,
``--file-mode``, ``--dir-mode``, ``--umask``; ``-o uid=…,gid=…,umask=…`` in fstab).

Invariants:
- Every entry answers with the same owner: the daemon's user and group unless told.
- The modes replace the mount's default bits: directories (the root, tags, ``.faultfs``)
  the tree shows 0755 get ``dir_mode``; regular files it shows 0644 or 0444 (chunks, views,
  pages, ``.pagemap``, the stats, user blobs created 0644) get ``file_mode`` — less its write
  bits where the tree says the file cannot be written (0444: a read-only mount, the stats),
  so a mode never promises a write the mount refuses. A mode a user gave an entry (a blob
  created 0600, a ``chmod``) is its own and is shown as it is: a private file stays private.
- Unset: the tree's own bits.
- The kernel checks the bits (``default_permissions``): a user the modes deny is denied;
  ``--allow-other`` still decides whether users other than the mounting one get in at all.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass

from faultfs.errors import InvalidInput

MAX_ID = (1 << 32) - 2  # (uid_t)-1 means "no change" to the kernel: never an owner
WRITE_BITS = 0o222
DEFAULT_DIR = 0o755  # the bits the tree gives a directory nobody chose a mode for
DEFAULT_FILES = (0o644, 0o444)  # ... and a file (0444: it cannot be written)
PERMISSION_BITS = 0o7777


@dataclass(frozen=True)
class Ownership:
    uid: int
    gid: int
    file_mode: int | None = None
    dir_mode: int | None = None

    def __post_init__(self) -> None:
        for what, value in (("uid", self.uid), ("gid", self.gid)):
            if not 0 <= value <= MAX_ID:
                raise InvalidInput(f"{what} {value} is not in [0, {MAX_ID}]")
        for what, mode in (("file mode", self.file_mode), ("dir mode", self.dir_mode)):
            if mode is not None and not 0 <= mode <= PERMISSION_BITS:
                raise InvalidInput(f"{what} {mode:o} is not an octal mode in [0, 7777]")

    @classmethod
    def with_umask(cls, uid: int, gid: int, umask: int, *, file_mode: int | None = None,
                   dir_mode: int | None = None) -> Ownership:
        """Modes from a umask (files 0666, directories 0777, less its bits), as vfat and
        ntfs-3g take it; an explicit ``file_mode``/``dir_mode`` wins."""
        if not 0 <= umask <= 0o777:
            raise InvalidInput(f"umask {umask:o} is not an octal mask in [0, 777]")
        return cls(uid, gid,
                   file_mode if file_mode is not None else 0o666 & ~umask,
                   dir_mode if dir_mode is not None else 0o777 & ~umask)

    def mode(self, mode: int) -> int:
        """The mode an entry answers with, from the tree's ``mode``."""
        bits = stat.S_IMODE(mode)
        if stat.S_ISDIR(mode):
            if self.dir_mode is None or bits != DEFAULT_DIR:
                return mode
            return stat.S_IFDIR | self.dir_mode
        if self.file_mode is None or bits not in DEFAULT_FILES:
            return mode
        bits = self.file_mode
        if not mode & WRITE_BITS:  # the tree says it cannot be written
            bits &= ~WRITE_BITS
        return stat.S_IFMT(mode) | bits


def parse_mode(text: str, what: str) -> int:
    """An octal mode as given on a command line or in fstab (``0640``, ``640``, ``0o640``)."""
    raw = str(text).strip().lower().removeprefix("0o")
    try:
        value = int(raw, 8)
    except ValueError:
        raise InvalidInput(f"{what} {text!r} is not an octal mode (try 0640)") from None
    if not raw or value > PERMISSION_BITS or value < 0:
        raise InvalidInput(f"{what} {text!r} is not an octal mode in [0, 7777]")
    return value
