"""Sealed objects: a keyed MAC over every object a node puts in the shared store, checked on
every object it gets (``--shared-store-key FILE``, DESIGN §13; the threat model is in
docs/decisions.md, "Who can write the shared store").

Every node holds write credentials to the shared store, and the checksums of a blob object
catch accidents, not a writer: anyone who can write the bucket can put an object with a
valid header and checksums and the wrong payload, and every node would serve it. A node
given the cluster's key seals what it puts — ``<object> <trailer>``, the trailer
``b"FFSSEAL1"`` and a 32-byte keyed BLAKE2b of the object's key and bytes — and accepts only
objects whose seal verifies: a writer without the key can still write the bucket, but
nothing it writes is served by a keyed node. The object's key is under the seal, so a
sealed object moved to another key does not verify either.

Invariants:
- With a key, ``get`` returns an object only when its seal verifies; one that does not, or
  has none, is a CorruptionError (the caller treats it as damaged: a blob is re-faulted from
  the source and published over it, a registry entry, claim, state or pagemap is ignored).
- Without a key, what a keyed node sealed still reads (its trailer cut off, unchecked: the
  checksums are all such a node has), and what it puts is not sealed.
- ``limit`` bounds the object without its trailer, as ``Objects.get``'s does (a longer
  one comes back as ``limit + 1`` bytes, for the caller to refuse by its length, never
  used).
- The key never leaves this object: not in messages, logs, the store or the shared store.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat

from faultfs.errors import CorruptionError, InvalidInput
from faultfs.tiers.objects import Objects

MAGIC = b"FFSSEAL1"
MAC_LEN = 32
TRAILER_LEN = len(MAGIC) + MAC_LEN
MIN_KEY_BYTES = 32  # 256 bits: `head -c 32 /dev/urandom > key` or `openssl rand -hex 32`
MAX_KEY_BYTES = 4096  # a key file larger than this is not a key
DOMAIN = b"faultfs shared object v1\0"


def load_key(path: str) -> bytes:
    """The cluster key in file ``path`` (at least ``MIN_KEY_BYTES``), as the 64-byte key of
    the MAC; one line of InvalidInput when it cannot be one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidInput(f"shared store key {path}: {exc.strerror}",
                           exc.errno or errno.EINVAL) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise InvalidInput(f"shared store key {path} is not a regular file")
        raw = f.read(MAX_KEY_BYTES + 1)
    secret = raw.strip()
    if len(raw) > MAX_KEY_BYTES or len(secret) < MIN_KEY_BYTES:
        raise InvalidInput(f"shared store key {path} must hold {MIN_KEY_BYTES} to "
                           f"{MAX_KEY_BYTES} bytes (e.g. `openssl rand -hex 32 > {path}`)")
    return hashlib.blake2b(secret, person=b"faultfs-key").digest()


class SealedObjects:
    """``Objects`` whose puts are sealed and whose gets are checked (``key``), or that only
    cut off the seals of keyed nodes (``key`` None)."""

    def __init__(self, objects: Objects, key: bytes | None) -> None:
        self.objects = objects
        self._key = key

    @property
    def url(self) -> str:
        return self.objects.url

    @property
    def sealed(self) -> bool:
        return self._key is not None

    def _mac(self, key: str, data: bytes | memoryview) -> bytes:
        assert self._key is not None
        mac = hashlib.blake2b(key=self._key, digest_size=MAC_LEN)
        mac.update(DOMAIN)
        mac.update(key.encode("utf-8", "surrogateescape"))
        mac.update(b"\0")
        mac.update(data)
        return mac.digest()

    def get(self, key: str, *, limit: int) -> bytes | None:
        raw = self.objects.get(key, limit=limit + TRAILER_LEN)
        if raw is None:
            return None
        if len(raw) > limit + TRAILER_LEN:
            return raw[:limit + 1]  # longer than its kind can be: the caller refuses it so
        has_seal = len(raw) >= TRAILER_LEN and raw[-TRAILER_LEN:-MAC_LEN] == MAGIC
        if self._key is None:
            return raw[:-TRAILER_LEN] if has_seal else raw
        if not has_seal:
            raise CorruptionError("not sealed with the shared store's key (a node without "
                                  "the key, or another writer, put it)")
        data = memoryview(raw)[:-TRAILER_LEN]
        if not hmac.compare_digest(raw[-MAC_LEN:], self._mac(key, data)):
            raise CorruptionError("its seal does not verify with the shared store's key "
                                  "(forged, damaged, or moved from another key)")
        return bytes(data)

    def put(self, key: str, data: bytes | memoryview, *, create: bool = False) -> bool:
        if self._key is not None:
            data = b"".join((data, MAGIC, self._mac(key, data)))
        return self.objects.put(key, data, create=create)

    def delete(self, key: str) -> None:
        self.objects.delete(key)

    def list(self, prefix: str) -> list[str]:
        return self.objects.list(prefix)
