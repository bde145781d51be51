"""Recent pins of objects, shared by the processes of a store (``pin_ttl``): an object pinned
less than ``pin_ttl`` seconds ago (by any process) is opened at that version without asking
its source, as mountpoint-s3's ``--metadata-ttl`` does; its source is opened only when a chunk
must be faulted, and refuses to read if the object changed meanwhile (never a mix).

Invariants:
- Off by default (``pin_ttl`` 0): every open asks the source for the version it has now.
- A record is a hint: unreadable, foreign or expired, it is no record. It holds a version
  (size and token) and when it was taken — no URL, no credential (its file is named by a
  hash of the object's identity).
"""

from __future__ import annotations

import json
import os
import secrets
import time

from faultfs.core.context import fnv1a64
from faultfs.sources import SourceVersion

PINS = "pins"
MAX_RECORD = 4096


class PinRecords:
    """``<store>/pins/``: one small file per object identity."""

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, PINS)

    def _path(self, identity: str) -> str:
        return os.path.join(self.root, f"{fnv1a64(identity.encode()):016x}")

    def fresh(self, identity: str, ttl: float) -> SourceVersion | None:
        """The version recorded for ``identity`` less than ``ttl`` seconds ago, or None."""
        if ttl <= 0:
            return None
        try:
            fd = os.open(self._path(identity), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            doc = json.loads(os.read(fd, MAX_RECORD))
            if doc["identity"] != fnv1a64(identity.encode()) or not 0 <= time.time() - float(
                    doc["at"]) < ttl:
                return None
            return SourceVersion(int(doc["size"]), str(doc["token"]))
        except (ValueError, KeyError, TypeError, OSError):
            return None
        finally:
            os.close(fd)

    def record(self, identity: str, version: SourceVersion) -> None:
        """Remember that ``identity`` has ``version`` now (best effort: a hint)."""
        doc = json.dumps({"identity": fnv1a64(identity.encode()), "size": version.size,
                          "token": version.token, "at": time.time()}).encode()
        path = self._path(identity)
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, doc)
            finally:
                os.close(fd)
            os.rename(tmp, path)
        except OSError:
            try:
                os.unlink(tmp)
            except OSError:
                pass
