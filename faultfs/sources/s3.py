"""S3 objects read with a synchronous botocore client on the caller's thread, pinned to a version.

Invariants:
- A versioned object is read by ``VersionId``; an unversioned one with ``If-Match`` on its
  ETag, and the response's ETag and ``Content-Range`` total are checked too, for servers that
  ignore ``If-Match`` — all before a byte of the body is handed on.
- A body goes from the socket straight into the caller's buffer (``recv_into``, no
  intermediate copies), piece by piece; ``progress(n)`` is told each time the first ``n``
  bytes are in. A short or long body is a transient failure (retried), never served.
- A connection is handed back to the client's pool only after a whole body was read; one
  that failed mid-body is closed.
- Reads run on the calling thread (the engine's I/O pool), with no event loop in between:
  the client and its connection pool are thread-safe (``filesystems.s3_client``). Object
  reads are GETs of presigned URLs on kept-alive connections (``s3http``) where that path
  fits the client's settings, botocore's ``get_object`` otherwise or after a redirect.
"""

from __future__ import annotations

import email.utils
import http.client
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from faultfs.buffers import alloc
from faultfs.sources.filesystems import s3_client, s3_connections, s3_presigner
from faultfs.sources.objects import ObjectStat, content_range, etag_core, status_phrase
from faultfs.sources.retry import (
    HTTP_TRANSIENT_STATUSES,
    Changed,
    Denied,
    Failure,
    IsDirectory,
    Missing,
    Permanent,
    Transient,
    transport_failure,
)
from faultfs.sources.s3sign import LightPresigner

BODY_PIECE = 1 << 20  # a body is read in pieces of at most this (one recv_into loop each)
PROGRESS_STEP = 128 << 10  # a streaming read tells the progress of its first piece this often
REDACTED = "***"  # what stands in for a secret in a persisted source URL
# S3 error codes that mean "try again later" even when the status is not 5xx.
S3_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "RequestThrottled", "RequestTimeout", "RequestTimeoutException", "ServiceUnavailable",
    "InternalError", "BandwidthLimitExceeded", "TooManyRequestsException",
})

Progress = Callable[[int], None]

log = logging.getLogger("faultfs.sources")


class S3Reader:
    """An S3 object, read with the synchronous botocore client made from a shared s3fs
    instance's settings (``filesystems.s3_client``)."""

    def __init__(self, fs: Any, path: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._scrub = scrub
        path, _, self._version_id = path.partition("?versionId=")
        self._bucket, _, self._key = path.partition("/")
        self._gets: Any = None  # s3http.PresignedGets, made at the first read
        self._botocore_only = False  # the presigned path does not fit (a redirect, settings)

    def _classify(self, exc: BaseException) -> Failure:
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, Failure):
            return exc
        if isinstance(exc, NoCredentialsError):
            return Denied("no AWS credentials found (set AWS_PROFILE or AWS_ACCESS_KEY_ID, "
                           "or use --anon for a public bucket)")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if not code or code == str(status):  # a HEAD answer has no body to name the error
                code = status_phrase(status)
            what = self._scrub(f"{code} (HTTP {status})")
            if code == "PreconditionFailed" or status == 412:
                return Changed("its ETag no longer matches the pinned one")
            if code == "InvalidRange" or status == 416:
                return Changed("the range is past its current end")
            if code == "NoSuchVersion":
                return Missing("the pinned version was deleted")
            if code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404") or status == 404:
                return Missing(what)
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId",
                                                 "SignatureDoesNotMatch", "ExpiredToken"):
                return Denied(what)
            if status >= 500 or status in HTTP_TRANSIENT_STATUSES or code in S3_TRANSIENT_CODES:
                return Transient(what)
            return Permanent(what)
        return transport_failure(exc, self._scrub) or Permanent(
            self._scrub(f"{type(exc).__name__}: {exc}")
        )

    def _client(self) -> Any:
        return s3_client(self._fs)

    def stat(self) -> ObjectStat:
        head = self._head_presigned()
        if head is not None:
            return head
        try:
            s3 = self._client()
            if not self._key or self._key.endswith("/"):
                if self._is_prefix(s3, self._key):
                    raise IsDirectory("is a directory")
                raise Missing("no such object")
            kw = {"VersionId": self._version_id} if self._version_id else {}
            try:
                out = s3.head_object(Bucket=self._bucket, Key=self._key, **kw)
            except Exception as exc:
                failure = self._classify(exc)
                if isinstance(failure, Missing) and not self._version_id:
                    if self._is_prefix(s3, self._key + "/"):
                        raise IsDirectory("is a directory") from None
                raise failure from None
        except Exception as exc:
            raise self._classify(exc) from None
        modified = out.get("LastModified")
        mtime = modified.timestamp() if isinstance(modified, datetime) else time.time()
        return _pinned(int(out["ContentLength"]), out.get("ETag", ""),
                       out.get("VersionId") or "", mtime)

    def _head_presigned(self) -> ObjectStat | None:
        """The object's stat from a presigned HEAD where URLs are made without a client
        (``s3sign``: a new process's first request then waits for no service model); None
        to ask the client (another setting, or any answer but 200: the client classifies
        it and tells an object from a prefix)."""
        if self._botocore_only or not self._key or self._key.endswith("/"):
            return None
        pool = s3_connections(self._fs)
        presigner = s3_presigner(self._fs, self._bucket)
        if pool is None or not isinstance(presigner, LightPresigner):
            return None
        from faultfs.sources.s3http import URL_EXPIRES_S, finish, send, split_url

        params = {"Bucket": self._bucket, "Key": self._key}
        if self._version_id:
            params["VersionId"] = self._version_id
        where, target = split_url(presigner.generate_presigned_url(
            "head_object", Params=params, ExpiresIn=URL_EXPIRES_S))
        try:
            resp, conn = send(pool, where, "HEAD", target, {})
        except Exception as exc:
            raise self._classify(exc) from None
        try:
            resp.read()
            if resp.status != 200:
                return None
            size = int(resp.getheader("Content-Length") or "")
            etag = resp.getheader("ETag", "")
            vid = resp.getheader("x-amz-version-id", "")
            modified = resp.getheader("Last-Modified", "")
        except (ValueError, OSError, http.client.HTTPException):
            return None
        finally:
            finish(pool, conn, resp, where, True)
        try:
            mtime = email.utils.parsedate_to_datetime(modified).timestamp()
        except (TypeError, ValueError):
            mtime = time.time()
        return _pinned(size, etag, vid, mtime)

    def _is_prefix(self, s3: Any, prefix: str) -> bool:
        try:
            out = s3.list_objects_v2(Bucket=self._bucket, Prefix=prefix, MaxKeys=1)
        except Exception as exc:
            failure = self._classify(exc)
            if isinstance(failure, Missing):
                return False
            raise failure from None
        return bool(out.get("KeyCount") or out.get("Contents") or out.get("CommonPrefixes"))

    def read(self, pin: ObjectStat, start: int, end: int) -> memoryview:
        buf = alloc(end - start)
        self.read_into(pin, start, end, buf)
        return buf

    def read_into(self, pin: ObjectStat, start: int, end: int, buf: memoryview,
                  progress: Progress | None = None, piece: int = BODY_PIECE) -> None:
        """Bytes ``[start, end)`` into ``buf`` (exactly that long), ``piece`` bytes at a time
        counted from ``start``, telling ``progress`` how many are in after each. Raises a
        ``Failure``; the bytes already told stay valid."""
        gets = self._presigned()
        if gets is not None:
            from faultfs.sources.s3http import UseBotocore

            try:
                self._read_presigned(gets, pin, start, end, buf, progress, max(1, piece))
                return
            except UseBotocore as exc:
                self._botocore_only = True
                log.info("s3://%s/%s: %s: read through botocore from now on", self._bucket,
                         self._scrub(self._key), self._scrub(str(exc)))
        if pin.version_id:
            cond = {"VersionId": pin.version_id}
        elif pin.etag:
            cond = {"IfMatch": pin.etag}
        else:
            cond = {}
        try:
            resp = self._client().get_object(
                Bucket=self._bucket, Key=self._key, Range=f"bytes={start}-{end - 1}", **cond)
        except Exception as exc:
            raise self._classify(exc) from None
        body = resp["Body"]
        try:
            self._check(pin, start, end, resp.get("ETag", ""), resp.get("ContentRange", ""),
                        resp.get("ContentLength"))
            read_body_into(body, buf, progress, max(1, piece))
        except BaseException as exc:
            _discard(body)
            if isinstance(exc, Exception):
                raise self._classify(exc) from None
            raise
        _release(body)

    def _presigned(self) -> Any:
        """The presigned-GET path of this object, or None (botocore's ``get_object``)."""
        if self._botocore_only:
            return None
        if self._gets is None:
            from faultfs.sources.s3http import PresignedGets

            pool = s3_connections(self._fs)
            if pool is None:
                self._botocore_only = True
                return None
            self._gets = PresignedGets(s3_presigner(self._fs, self._bucket), pool,
                                       self._bucket, self._key)
        return self._gets

    def _read_presigned(self, gets: Any, pin: ObjectStat, start: int, end: int,
                        buf: memoryview, progress: Progress | None, piece: int) -> None:
        from faultfs.sources.s3http import UseBotocore

        try:
            resp, conn, where = gets.get(start, end, pin.version_id, pin.etag)
        except UseBotocore:
            raise
        except Exception as exc:
            raise self._classify(exc) from None
        whole = False
        try:
            self._check(pin, start, end, resp.getheader("ETag", ""),
                        resp.getheader("Content-Range", ""), resp.getheader("Content-Length"))
            fill(resp.readinto, buf, progress, piece)
            if resp.length:  # the server announced more than was asked for
                raise Transient(f"long body: more than {end - start} bytes")
            whole = True
        except BaseException as exc:
            if isinstance(exc, Exception):
                raise self._classify(exc) from None
            raise
        finally:
            gets.finish(conn, resp, where, whole)

    @staticmethod
    def _check(pin: ObjectStat, start: int, end: int, etag: str, crange: str,
               length: Any) -> None:
        """The answer's head against the pin and the range asked for (before any body byte
        is handed on)."""
        if pin.etag and etag and etag_core(etag) != etag_core(pin.etag):
            raise Changed(f"its ETag is now {etag}")
        _, total = content_range(crange or "")
        if total is not None and total != pin.size:
            raise Changed(f"its size is now {total}")
        if length is not None and int(length) != end - start:
            what = "long" if int(length) > end - start else "short"
            raise Transient(f"{what} body: {length} of {end - start} bytes")


def fill(readinto: Callable[[memoryview], int | None], buf: memoryview,
         progress: Progress | None, piece: int) -> None:
    """``len(buf)`` bytes into ``buf`` with ``readinto`` (``http.client``'s loops on
    ``recv_into`` with the GIL released until its view is full), ``piece`` bytes at a time
    — the first piece ``PROGRESS_STEP`` at a time, so the reader a request is for (of the
    head of its first blob, mostly) hears of its bytes early —, ``progress(n)`` after each;
    a body that ends early is Transient."""
    size = len(buf)
    pos = 0
    step = min(piece, PROGRESS_STEP) if progress is not None else piece
    edge = getattr(buf, "edge", None)  # a destination in pieces of its own (``Pieces``)
    while pos < size:
        stop = min(size, (pos // step + 1) * step if pos < piece else size,
                   (pos // piece + 1) * piece)
        if edge is not None:
            stop = min(stop, edge(pos))
        n = readinto(buf[pos:stop])
        if not n:
            raise Transient(f"short body: {pos} of {size} bytes")
        pos += n
        if progress is not None and pos == stop:
            progress(pos)


def _raw(body: Any) -> tuple[Any, http.client.HTTPResponse | None]:
    """The urllib3 response under a botocore body, and the ``http.client`` response under that
    when its bytes can be read straight from the socket (no content decoding)."""
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or fp.chunked:
        return raw, None
    encoding = (raw.headers.get("content-encoding") or "identity").lower()
    return raw, (fp if encoding == "identity" else None)


def _pinned(size: int, etag: str, vid: str, mtime: float) -> ObjectStat:
    """An object's stat, pinned by its version, else its ETag."""
    if vid == "null":  # written while versioning was off or suspended: not addressable
        vid = ""
    token = f"vid:{vid}" if vid else (f"etag:{etag}" if etag else "unpinned")
    return ObjectStat(size, token, mtime, etag=etag, version_id=vid)


def read_body_into(body: Any, buf: memoryview, progress: Progress | None, piece: int) -> None:
    """``len(buf)`` bytes of a botocore response body into ``buf``: straight from the socket
    when the body is plain, else through the body's own ``read``. Short or long bodies are
    Transient."""
    _, fp = _raw(body)
    if fp is not None:
        fill(fp.readinto, buf, progress, piece)
        if fp.length:  # the server announced more than was asked for
            raise Transient(f"long body: more than {len(buf)} bytes")
        return

    def readinto(view: memoryview) -> int:
        data = body.read(len(view))
        view[:len(data)] = data
        return len(data)

    fill(readinto, buf, progress, piece)
    if body.read(1):
        raise Transient(f"long body: more than {len(buf)} bytes")


def _release(body: Any) -> None:
    """Hand a wholly read body's connection back to the pool."""
    raw, fp = _raw(body)
    if fp is not None and raw is not None:
        raw.release_conn()  # http.client closed its side at the body's end
    else:
        body.close()


def _discard(body: Any) -> None:
    """Close the connection of a body that was not read whole (never reused mid-body)."""
    raw, _ = _raw(body)
    try:
        if raw is not None:
            raw.close()
            raw.release_conn()  # the closed connection reopens at its next use
        else:
            body.close()
    except Exception:  # a broken connection that will not close is dropped anyway
        pass
