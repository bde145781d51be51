"""Claim objects: who fetches a window of blobs from the source, told through the shared store
alone (DESIGN §17). The format, the keys, and the conditional operations each kind of store
offers for them (blocking; the claim board runs them on threads).

A claim object lives at ``claims/<fault key>/<version hash>/<window>``, apart from the blob
objects (``blobs/…``) and the registry, and is canonical JSON (sorted keys, no spaces):
``{"count":N,"deadline_ms":T,"done":"…","first":I,"gen":G,"node":"…","state":"fetching","v":2}``
— the blobs ``[first, first+count)`` of the window, the claimer's node id, the wall-clock
deadline in milliseconds since the epoch after which any node may take it over, the
generation (1 when created, one more at each takeover), the state: ``fetching``, or
``published`` once the holder's blobs are in the store; and ``done``, the blobs of the window
published under its claims so far (a bitmap in hex, bit ``i`` = the window's blob ``i``).
A released claim stays as a ``published`` marker: the window's **index**. A window with no
claim object has had no claim, so nothing of it was published under one: a node whose create
wins reads the source without asking the store for each blob. docs/FORMAT.md pins it.

Invariants:
- ``create`` makes an object only where none is (``If-None-Match: *`` on S3; a hard link in
  a directory); ``replace`` only over the object whose tag it was given (``If-Match`` on the
  ETag; a rename of exactly that file in a directory). Each answers None when it lost.
- Every failure of the store is an ``OSError``; losing a race is not a failure.
- ``claim_mode`` says which of the modes a store runs in: ``conditional`` (S3 honouring both
  conditions), ``exclusive`` (a directory: exclusive create, takeover by rename), ``off``
  (neither: no claims, each node fetches what it misses, as before claims).
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from faultfs.errors import CorruptionError
from faultfs.tiers.objects import FsspecObjects, LocalObjects, Objects
from faultfs.tiers.sealed import SealedObjects

CLAIM_PREFIX = "claims/"
CLAIM_VERSION = 2  # 2: ``done``, and released claims stay as the window's index
CLAIM_MAX_BYTES = 4096  # a claim is a few dozen bytes: anything larger is not one of ours
DONE_MAX_DIGITS = 1024  # a window of 4096 blobs at most (8 MiB of 2 KiB blobs)
MODES = ("conditional", "exclusive", "off")


@dataclass(frozen=True)
class Claim:
    node: str
    gen: int
    deadline_ms: int
    first: int
    count: int
    published: bool = False  # the holder's blobs are in the store: load them
    done: int = 0  # bitmap of the window's blobs published under its claims (bit i: blob i)

    def encode(self) -> bytes:
        return json.dumps({"count": self.count, "deadline_ms": self.deadline_ms,
                           "done": format(self.done, "x"),
                           "first": self.first, "gen": self.gen, "node": self.node,
                           "state": "published" if self.published else "fetching",
                           "v": CLAIM_VERSION}, sort_keys=True,
                          separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Claim:
        """The claim in ``raw``; CorruptionError for anything else (a torn or foreign object)."""
        if len(raw) > CLAIM_MAX_BYTES:
            raise CorruptionError(f"claim object of {len(raw)} bytes")
        try:
            d = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise CorruptionError("claim object is not JSON") from None
        if not isinstance(d, dict) or d.get("v") != CLAIM_VERSION:
            raise CorruptionError("claim object of an unknown version")
        ints = ("count", "deadline_ms", "first", "gen")
        if (set(d) != {*ints, "done", "node", "state", "v"} or not isinstance(d["node"], str)
                or d["state"] not in ("fetching", "published")
                or not all(type(d[k]) is int and d[k] >= 0 for k in ints)
                or not isinstance(d["done"], str) or len(d["done"]) > DONE_MAX_DIGITS
                or not re.fullmatch("0|[1-9a-f][0-9a-f]*", d["done"])):
            raise CorruptionError("claim object has wrong fields")
        return cls(d["node"], d["gen"], d["deadline_ms"], d["first"], d["count"],
                   d["state"] == "published", int(d["done"], 16))

    def expired(self, now_ms: int) -> bool:
        return now_ms >= self.deadline_ms

    def published_of(self, base: int, indices: list[int]) -> list[int]:
        """Those of ``indices`` (blobs of the window starting at blob ``base``) that ``done``
        says are published."""
        return [i for i in indices if 0 <= i - base and self.done >> (i - base) & 1]


def now_ms() -> int:
    """Wall clock in ms: what claims' deadlines are in (nodes' clocks are assumed close)."""
    return int(time.time() * 1000)


def done_mask(base: int, indices: Iterable[int]) -> int:
    """The ``done`` bits of blobs ``indices`` of the window starting at blob ``base``."""
    mask = 0
    for i in indices:
        mask |= 1 << (i - base)
    return mask


def claim_key(fault: str, version_hash: str, window: int) -> str:
    """The key of a window's claim: beside its blobs' ``blobs/<fault>/<version hash>/``."""
    return f"{CLAIM_PREFIX}{fault}/{version_hash}/{window}"


class ClaimStore(Protocol):
    mode: str

    def read(self, key: str) -> tuple[bytes, str] | None:
        """The object and its tag (ETag), or None when absent."""
        ...

    def create(self, key: str, data: bytes) -> str | None:
        """Make the object where none is: its tag, or None when one is there."""
        ...

    def replace(self, key: str, data: bytes, tag: str) -> str | None:
        """Replace the object only if it is still the one of ``tag``: the new tag, or None."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Write the object whatever is there (a mailbox: ``mailbox.py``)."""
        ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> list[str]: ...


class DirectoryClaims:
    """Claims in a directory (a local or network file system): an exclusive create by hard
    link; a takeover renames exactly the file it read (its inode is its tag) out of the way,
    so of several nodes taking over one expired claim one rename wins."""

    mode = "exclusive"

    def __init__(self, objects: LocalObjects) -> None:
        self.objects = objects

    def _path(self, key: str) -> str:
        return os.path.join(self.objects.root, *key.split("/"))

    @staticmethod
    def _tag(st: os.stat_result) -> str:
        return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"

    def read(self, key: str) -> tuple[bytes, str] | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(CLAIM_MAX_BYTES + 1), self._tag(os.fstat(fd))

    def create(self, key: str, data: bytes) -> str | None:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{secrets.token_hex(6)}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
            return self._tag(os.stat(tmp))
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)

    def replace(self, key: str, data: bytes, tag: str) -> str | None:
        path = self._path(key)
        aside = f"{path}.tmp-taken-{secrets.token_hex(6)}"
        try:
            os.rename(path, aside)  # of several nodes, one moves it
        except FileNotFoundError:
            return None
        try:
            if self._tag(os.stat(aside)) != tag:  # another node's newer claim: put it back
                try:
                    os.link(aside, path)
                except FileExistsError:
                    pass
                return None
        finally:
            os.unlink(aside)
        return self.create(key, data)

    def put(self, key: str, data: bytes) -> None:
        self.objects.put(key, data)

    def delete(self, key: str) -> None:
        self.objects.delete(key)

    def list(self, prefix: str) -> list[str]:
        return self.objects.list(prefix)


class S3Claims:
    """Claims on S3 (or an endpoint that speaks its conditional writes): ``If-None-Match: *``
    creates, ``If-Match: <ETag>`` replaces, through the s3fs client of the shared store."""

    mode = "conditional"

    def __init__(self, objects: FsspecObjects) -> None:
        self.objects = objects
        self.fs = objects.fs

    def _where(self, key: str) -> dict[str, str]:
        bucket, _, path = f"{self.objects.root}/{key}".partition("/")
        return {"Bucket": bucket, "Key": path}

    def _call(self, method: str, **kwargs: Any) -> Any:
        from fsspec.asyn import sync

        async def go() -> Any:
            out = await self.fs._call_s3(method, **kwargs)
            if "Body" in out and hasattr(out["Body"], "read"):
                body = out["Body"]
                try:
                    out["Body"] = await body.read()
                finally:
                    body.close()
            return out

        return sync(self.fs.loop, go)

    def _put(self, key: str, data: bytes, **condition: str) -> str | None:
        done, tag = self.objects.via_direct(lambda direct: direct.put(
            self.objects.direct_key(key), data, if_none_match="IfNoneMatch" in condition,
            if_match=condition.get("IfMatch", "")))
        if done:
            return tag
        try:
            return self._call("put_object", Body=data, **self._where(key), **condition)["ETag"]
        except FileExistsError:  # 412 on If-None-Match
            return None
        except FileNotFoundError:  # If-Match on an object that went away
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL or _lost_race(exc):  # 412 on If-Match, 409
                return None
            raise
        except Exception as exc:
            if _lost_race(exc):
                return None
            raise OSError(errno.EIO, f"{type(exc).__name__}: {exc}") from None

    def read(self, key: str) -> tuple[bytes, str] | None:
        done, got = self.objects.via_direct(
            lambda direct: direct.get(self.objects.direct_key(key), CLAIM_MAX_BYTES))
        if done:
            return got
        try:
            out = self._call("get_object", **self._where(key))
        except FileNotFoundError:
            return None
        except OSError:
            raise
        except Exception as exc:
            raise OSError(errno.EIO, f"{type(exc).__name__}: {exc}") from None
        return bytes(out["Body"][:CLAIM_MAX_BYTES + 1]), out["ETag"]

    def create(self, key: str, data: bytes) -> str | None:
        return self._put(key, data, IfNoneMatch="*")

    def replace(self, key: str, data: bytes, tag: str) -> str | None:
        return self._put(key, data, IfMatch=tag)

    def put(self, key: str, data: bytes) -> None:
        self.objects.put(key, data)

    def delete(self, key: str) -> None:
        self.objects.delete(key)

    def list(self, prefix: str) -> list[str]:
        return self.objects.list(prefix)


def _lost_race(exc: BaseException) -> bool:
    """A 409 ConditionalRequestConflict: another conditional write to the key was under way."""
    text = str(exc)
    return "ConditionalRequestConflict" in text or "PreconditionFailed" in text


def claim_store(objects: Objects) -> ClaimStore | None:
    """The claim operations the shared store offers, or None (mode ``off``). A sealed store's
    claims are its plain objects: a claim holds no data (a forged one can make nodes wait
    until its deadline, never serve bytes, which a node takes only from sealed blobs)."""
    if isinstance(objects, SealedObjects):
        objects = objects.objects
    if isinstance(objects, LocalObjects):
        return DirectoryClaims(objects)
    if isinstance(objects, FsspecObjects) and "s3" in _protocols(objects.fs):
        return S3Claims(objects)
    return None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def probe_claims(store: ClaimStore) -> bool:
    """Whether the store really honours the conditions (blocking): a second create of one key
    must lose, a replace under a wrong tag must lose, one under the right tag must win. An
    endpoint that ignores the headers (some S3 look-alikes do) would let every node win.
    Leaves nothing behind; OSError when the store fails."""
    key = f"{CLAIM_PREFIX}probe-{secrets.token_hex(8)}"
    try:
        first = store.create(key, b"{}")
        if first is None:
            return False
        if store.create(key, b"{}") is not None:
            return False
        if store.replace(key, b"{ }", "\"not-the-tag\"") is not None:
            return False
        return store.replace(key, b"{}", first) is not None
    finally:
        store.delete(key)


def open_claims(objects: Objects, *, enabled: bool = True) -> tuple[ClaimStore | None, str]:
    """The claim operations of the shared store when it really has them (probed: blocking),
    and one line for the user saying which mode the mount runs in."""
    url = objects.url
    without = "each node that misses a blob reads it from the source, even at the same moment"
    if not enabled:
        return None, f"shared store {url}: claims off (--no-shared-claims): {without}"
    store = claim_store(objects)
    if store is None:
        return None, (f"shared store {url}: this kind of store has no conditional puts, claims "
                      f"off: {without}")
    try:
        honoured = probe_claims(store)
    except OSError as exc:
        return None, (f"shared store {url}: conditional puts failed ({exc.strerror or exc}), "
                      f"claims off: {without}")
    if not honoured:
        return None, (f"shared store {url} ignores conditional puts (If-None-Match/If-Match), "
                      f"claims off: {without}")
    how = ("conditional puts (If-None-Match, If-Match)" if store.mode == "conditional"
           else "exclusive creates and renames in a directory")
    return store, f"shared store {url}: blobs fetched once per cluster, claimed by {how}"
