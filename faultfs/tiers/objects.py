"""Objects of a shared store: whole-object gets and atomic whole-object puts, on S3 (presigned
requests on kept-alive connections where the client allows, else s3fs; s3fs lists and deletes),
a local directory, or any fsspec file system (DESIGN §13).

Invariants:
- ``get`` returns a whole object or None (absent), and never reads more of one than
  ``limit + 1`` bytes: a caller bounds each object by what its kind can be (a blob object
  its header and one blob, a registry entry a context …) and refuses a longer one by its
  length, so a hostile object of any size costs at most that much memory and transfer (a
  ranged GET on S3). ``put`` replaces an object atomically (an S3 PUT, a rename), so a
  reader never sees half of one.
- ``put(create=True)`` never replaces an object: it answers False when one is there. It is a
  conditional put (S3 ``If-None-Match: *``, a hard link) where the store supports it, else
  a check then a put — safe here, because the objects that may race are immutable (two
  nodes write the same bytes under the same key).
- Every operation raises ``OSError`` for a failure of the store (unreachable, refused,
  timed out), never an endpoint's own exception type.
- Credentials never appear in ``url`` (what logs and ``faultfs stat`` show).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from faultfs.errors import InvalidInput
from faultfs.sources import S3_PROTOCOLS, SourceOptions, local_path, url_protocol
from faultfs.sources.filesystems import s3_filesystem_kwargs
from faultfs.sources.secrets import display_url

log = logging.getLogger("faultfs.shared")

# A shared store is a cache: when it is slow the source is the faster way. Give up early.
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 10.0


class Objects(Protocol):
    url: str  # for messages: no credentials

    def get(self, key: str, *, limit: int) -> bytes | None:
        """The object under ``key`` (None: absent), at most its first ``limit + 1`` bytes."""
        ...

    def put(self, key: str, data: bytes | memoryview, *, create: bool = False) -> bool:
        """Store ``data`` under ``key``; False when ``create`` and an object is there."""
        ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (a "directory": ending in "/"), relative to the store."""
        ...


class LocalObjects:
    """A directory as an object store (one file per object; a rename publishes it)."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)
        self.url = self.root

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def get(self, key: str, *, limit: int) -> bytes | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except (FileNotFoundError, NotADirectoryError):
            return None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None  # a FIFO or a device where an object should be: absent
            return f.read(limit + 1)

    def put(self, key: str, data: bytes | memoryview, *, create: bool = False) -> bool:
        path = self._path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{secrets.token_hex(6)}"
        with open(tmp, "wb") as f:
            f.write(data)
        try:
            if create:
                try:
                    os.link(tmp, path)  # fails when the object is there: a conditional put
                except FileExistsError:
                    return False
            else:
                os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        return True

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        parent = os.path.dirname(path)
        while parent != self.root and parent.startswith(self.root):
            try:
                os.rmdir(parent)  # only when empty
            except OSError:
                break
            parent = os.path.dirname(parent)

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/"))
        out = []
        for directory, _, files in os.walk(base):
            for name in files:
                if ".tmp-" in name:
                    continue
                rel = os.path.relpath(os.path.join(directory, name), self.root)
                out.append(rel.replace(os.sep, "/"))
        return sorted(out)


class FsspecObjects:
    """Objects on an fsspec file system (S3 through s3fs, GCS, …) under ``root``."""

    def __init__(self, fs: Any, root: str, url: str, *, conditional: bool = True,
                 get_options: dict | None = None, direct: Any = None) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.url = url
        self.conditional = conditional  # the store honours If-None-Match (found out on use)
        self.get_options = get_options or {}
        # S3: gets and puts through presigned URLs (sources.s3http.PresignedObjects) where
        # the client's settings allow; None after a redirect (botocore follows those)
        self.direct = direct

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def direct_key(self, key: str) -> str:
        """``key``'s object key within the bucket (``direct``'s)."""
        return self._path(key).partition("/")[2]

    def via_direct(self, call: Callable[[Any], Any]) -> tuple[bool, Any]:
        """``call(direct)`` where the presigned path is: (True, what it answered); (False,
        None) where it is not, or a redirect just turned it off (botocore from then on). Its
        failures are raised as ``OSError``."""
        direct = self.direct
        if direct is None:
            return False, None
        from faultfs.sources.s3http import UseBotocore

        try:
            return True, call(direct)
        except UseBotocore as exc:
            log.info("shared store %s: %s: objects through botocore from now on", self.url,
                     exc)
            self.direct = None
            return False, None
        except OSError:
            raise
        except Exception as exc:  # an error answer, http.client's own errors
            raise _failure(exc) from None

    def get(self, key: str, *, limit: int) -> bytes | None:
        done, got = self.via_direct(lambda direct: direct.get(self.direct_key(key), limit))
        if done:
            return None if got is None else got[0]
        try:  # a ranged GET: the endpoint sends no more than that
            return bytes(self.fs.cat_file(self._path(key), start=0, end=limit + 1,
                                          **self.get_options))
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL and "range" in str(exc).lower():
                return b""  # (S3 answers a range of an empty object with InvalidRange)
            raise
        except Exception as exc:  # botocore and aiohttp errors: the store failed
            raise _failure(exc) from None

    def put(self, key: str, data: bytes | memoryview, *, create: bool = False) -> bool:
        done, put = self.via_direct(lambda direct: self._put_direct(direct, key, data, create))
        if done:
            return put
        path = self._path(key)
        body = bytes(data)
        try:
            if create and self.conditional:
                try:
                    self.fs.pipe_file(path, body, mode="create")
                    return True
                except FileExistsError:
                    return False
                except (NotImplementedError, TypeError):
                    self.conditional = False  # an endpoint without conditional puts
                except OSError as exc:
                    if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                        raise
                    self.conditional = False
            if create and self.fs.exists(path):
                return False
            self.fs.pipe_file(path, body)
            return True
        except OSError:
            raise
        except Exception as exc:
            raise _failure(exc) from None

    def _put_direct(self, direct: Any, key: str, data: bytes | memoryview, create: bool) -> bool:
        """``put`` through the presigned path (its errors raised as they come)."""
        where = self.direct_key(key)
        if create and self.conditional:
            try:
                return direct.put(where, data, if_none_match=True) is not None
            except Exception as exc:
                if not _unsupported(exc):
                    raise
                self.conditional = False  # an endpoint without conditional puts
        if create and direct.get(where, 0) is not None:
            return False
        direct.put(where, data)
        return True

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass
        except OSError:
            raise
        except Exception as exc:
            raise _failure(exc) from None

    def list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/"))
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        except OSError:
            raise
        except Exception as exc:
            raise _failure(exc) from None
        cut = len(self.root) + 1
        return sorted(p[cut:] for p in found if p.startswith(self.root + "/"))


def _failure(exc: Exception) -> OSError:
    return OSError(errno.EIO, f"{type(exc).__name__}: {exc}")


def _unsupported(exc: Exception) -> bool:
    """An answer saying the endpoint has no conditional puts (501 NotImplemented)."""
    meta = getattr(exc, "response", None) or {}
    return (meta.get("ResponseMetadata", {}).get("HTTPStatusCode") == 501
            or meta.get("Error", {}).get("Code") == "NotImplemented")


def open_objects(url: str, options: SourceOptions, *, endpoint_url: str = "",
                 conditional: bool = True) -> Objects:
    """The object store at ``url`` (``s3://bucket/prefix``, a local directory, any fsspec
    URL); credentials follow the AWS conventions, as for sources. Checks nothing remote."""
    if not url:
        raise InvalidInput("the shared store URL is empty")
    path = local_path(url)
    if path is not None:
        return LocalObjects(path)
    import fsspec

    protocol = url_protocol(url)
    shown = display_url(url)
    if protocol in S3_PROTOCOLS:
        if endpoint_url:
            options = replace(options, s3_endpoint_url=endpoint_url)
        kwargs = s3_filesystem_kwargs(options)
        kwargs["config_kwargs"] = {**kwargs["config_kwargs"],
                                   "connect_timeout": CONNECT_TIMEOUT_S,
                                   "read_timeout": READ_TIMEOUT_S}
        try:
            fs = fsspec.filesystem("s3", **kwargs)
        except Exception as exc:
            raise InvalidInput(f"shared store {shown}: {exc}") from None
        fs.retries = 2  # s3fs's own loop (default 5): a failing store degrades to the source
        root = url.split("://", 1)[1].split("?", 1)[0].rstrip("/")
        if not root:
            raise InvalidInput(f"shared store {shown} names no bucket")
        # one GET per object: without it s3fs asks for the size first (a HEAD, and a LIST
        # after a 404), doubling the round trips of every load and miss
        return FsspecObjects(fs, root, shown, conditional=conditional,
                             get_options={"max_concurrency": 1}, direct=_direct(fs, root))
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except Exception as exc:
        raise InvalidInput(f"shared store {shown}: {exc}") from None
    return FsspecObjects(fs, root, shown, conditional=conditional)


def _direct(fs: Any, root: str) -> Any:
    """Presigned gets and puts of the store's bucket, or None (botocore: a proxy, client
    certificates … ``sources.s3http.usable``)."""
    from faultfs.sources.filesystems import s3_connections, s3_presigner
    from faultfs.sources.s3http import PresignedObjects

    try:
        pool = s3_connections(fs)
        if pool is None:
            return None
        bucket = root.partition("/")[0]
        return PresignedObjects(s3_presigner(fs, bucket), pool, bucket)
    except Exception as exc:  # a client botocore cannot make: s3fs will say so on use
        log.debug("shared store: no presigned path: %s", exc)
        return None


def probe(objects: Objects) -> None:
    """Check that the store can be listed, written, read and deleted (blocking); one line of
    InvalidInput when not. Leaves nothing behind."""
    key = f"probe/{secrets.token_hex(8)}"
    data = b"faultfs probe\n"
    try:
        objects.list("registry/")
        objects.put(key, data)
        back = objects.get(key, limit=len(data))
        objects.delete(key)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise InvalidInput(f"shared store {objects.url} cannot be used: {reason}",
                           errno.EIO) from None
    if back != data:
        raise InvalidInput(f"shared store {objects.url} did not return what was written to it",
                           errno.EIO)
