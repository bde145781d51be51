"""Recent pins of objects, shared by the processes of a store (``pin_ttl``): an object pinned
less than ``pin_ttl`` seconds ago (by any process) is opened at that version without asking
its source — the check fsspec's own caches skip for good, done here once a ttl, as
mountpoint-s3's ``--metadata-ttl`` (60 s by default with its data cache) does; its source is
opened only when a chunk must be faulted, and refuses to read if the object changed
meanwhile (never a mix).

Invariants:
- ``pin_ttl`` 0 asks the source on every open (the behaviour before the ttl existed).
- Every pin taken from the source is recorded, whatever this process's ttl: a process that
  asks on every open keeps the record current for those that do not.
- A record is a hint: unreadable, foreign or expired, it is no record. It holds a version
  (size and token) and when it was taken — no URL, no credential (its file is named by a
  hash of the object's identity).
- A pin found stale (its object changed or is gone) is forgotten at once, by any process, so
  the next open asks the source and names a new tag instead of failing until the ttl ends.
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import xxhash

from faultfs.sources import SourceVersion
from faultfs.store.durable import write_atomic

PINS = "pins"
MAX_RECORD = 4096
DEFAULT_PIN_TTL = 60.0  # seconds: mountpoint-s3's metadata ttl when it caches data


@functools.lru_cache(maxsize=4096)
def identity_hash(identity: str) -> int:
    """The record name of ``identity`` (xxh3: a record is a hint, so its name may change
    between versions — a record of another name is no record, and the next open asks)."""
    return xxhash.xxh3_64_intdigest(identity.encode())


class PinRecords:
    """``<store>/pins/``: one small file per object identity."""

    def __init__(self, root: str) -> None:
        self.root = os.path.join(root, PINS)

    def _path(self, identity: str) -> str:
        return os.path.join(self.root, f"{identity_hash(identity):016x}")

    def fresh(self, identity: str, ttl: float) -> SourceVersion | None:
        """The version recorded for ``identity`` less than ``ttl`` seconds ago, or None."""
        if ttl <= 0:
            return None
        doc = self._load(identity)
        if doc is None or not 0 <= time.time() - float(doc["at"]) < ttl:
            return None
        return SourceVersion(int(doc["size"]), str(doc["token"]))

    def _load(self, identity: str) -> dict[str, Any] | None:
        try:
            fd = os.open(self._path(identity), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            doc: dict[str, Any] = json.loads(os.read(fd, MAX_RECORD))
            if doc["identity"] != identity_hash(identity):
                return None
            float(doc["at"]), int(doc["size"]), str(doc["token"])  # all there
            return doc
        except (ValueError, KeyError, TypeError, OSError):
            return None
        finally:
            os.close(fd)

    def record(self, identity: str, version: SourceVersion) -> None:
        """Remember that ``identity`` has ``version`` now (best effort: a hint)."""
        doc = json.dumps({"identity": identity_hash(identity), "size": version.size,
                          "token": version.token, "at": time.time()}).encode()
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            write_atomic(self._path(identity), [doc], mode=0o600, durable=False)
        except OSError:
            pass

    def forget(self, identity: str, version: SourceVersion) -> None:
        """Drop the record of ``identity`` if it still names ``version`` (found stale); a
        newer one another process recorded meanwhile stays (but for a race of a moment, in
        which it goes too: the next open then asks the source — a hint lost, nothing else)."""
        doc = self._load(identity)
        if doc is None or (int(doc["size"]), str(doc["token"])) != (version.size,
                                                                     version.token):
            return
        try:
            os.unlink(self._path(identity))
        except OSError:
            pass
