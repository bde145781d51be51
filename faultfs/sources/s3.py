"""S3 objects read with the aiobotocore client of a shared s3fs instance, pinned to a version.

Invariants:
- A versioned object is read by ``VersionId``; an unversioned one with ``If-Match`` on its
  ETag, and the response's ETag and ``Content-Range`` total are checked too, for servers that
  ignore ``If-Match``.
- A body is copied piece by piece into one pooled buffer of exactly the requested size; a
  short or long body is a transient failure (retried), never served.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from fsspec.asyn import sync

from faultfs.buffers import alloc
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

BODY_PIECE = 512 << 10  # an S3 body is copied into its buffer in pieces of up to this
REDACTED = "***"  # what stands in for a secret in a persisted source URL
# S3 error codes that mean "try again later" even when the status is not 5xx.
S3_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "RequestThrottled", "RequestTimeout", "RequestTimeoutException", "ServiceUnavailable",
    "InternalError", "BandwidthLimitExceeded", "TooManyRequestsException",
})


class S3Reader:
    """An S3 object, read with the aiobotocore client of a shared s3fs instance."""

    def __init__(self, fs: Any, path: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._scrub = scrub
        path, _, self._version_id = path.partition("?versionId=")
        self._bucket, _, self._key = path.partition("/")

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

    async def _client(self) -> Any:
        await self._fs.set_session()
        return await self._fs.get_s3(self._bucket)

    def stat(self) -> ObjectStat:
        return sync(self._fs.loop, self._stat)

    async def _stat(self) -> ObjectStat:
        try:
            s3 = await self._client()
            if not self._key or self._key.endswith("/"):
                if await self._is_prefix(s3, self._key):
                    raise IsDirectory("is a directory")
                raise Missing("no such object")
            kw = {"VersionId": self._version_id} if self._version_id else {}
            try:
                out = await s3.head_object(Bucket=self._bucket, Key=self._key, **kw)
            except Exception as exc:
                failure = self._classify(exc)
                if isinstance(failure, Missing) and not self._version_id:
                    if await self._is_prefix(s3, self._key + "/"):
                        raise IsDirectory("is a directory") from None
                raise failure from None
        except Exception as exc:
            raise self._classify(exc) from None
        etag = out.get("ETag", "")
        vid = out.get("VersionId") or ""
        if vid == "null":  # written while versioning was off or suspended: not addressable
            vid = ""
        modified = out.get("LastModified")
        mtime = modified.timestamp() if isinstance(modified, datetime) else time.time()
        size = int(out["ContentLength"])
        token = f"vid:{vid}" if vid else (f"etag:{etag}" if etag else "unpinned")
        return ObjectStat(size, token, mtime, etag=etag, version_id=vid)

    async def _is_prefix(self, s3: Any, prefix: str) -> bool:
        try:
            out = await s3.list_objects_v2(Bucket=self._bucket, Prefix=prefix, MaxKeys=1)
        except Exception as exc:
            failure = self._classify(exc)
            if isinstance(failure, Missing):
                return False
            raise failure from None
        return bool(out.get("KeyCount") or out.get("Contents") or out.get("CommonPrefixes"))

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes | memoryview:
        return sync(self._fs.loop, self._read, pin, start, end)

    async def _read(self, pin: ObjectStat, start: int, end: int) -> bytes | memoryview:
        if pin.version_id:
            cond = {"VersionId": pin.version_id}
        elif pin.etag:
            cond = {"IfMatch": pin.etag}
        else:
            cond = {}
        try:
            s3 = await self._client()
            resp = await s3.get_object(
                Bucket=self._bucket, Key=self._key, Range=f"bytes={start}-{end - 1}", **cond
            )
            body = resp["Body"]
            try:
                data = await read_body(body, end - start)
            finally:
                body.close()
        except Exception as exc:
            raise self._classify(exc) from None
        etag = resp.get("ETag", "")
        if pin.etag and etag and etag_core(etag) != etag_core(pin.etag):
            raise Changed(f"its ETag is now {etag}")
        _, total = content_range(resp.get("ContentRange", ""))
        if total is not None and total != pin.size:
            raise Changed(f"its size is now {total}")
        if len(data) != end - start:
            raise Transient(f"short body: {len(data)} of {end - start} bytes")
        return data


async def read_body(body, size: int) -> memoryview:
    """An S3 response body copied piece by piece into one buffer of ``size`` bytes from the
    shared pool (one copy into memory already mapped, instead of a join into a new mapping);
    shorter when the body is."""
    buf = alloc(size)
    pos = 0
    while True:
        piece = await body.read(BODY_PIECE)
        if not piece:
            return buf[:pos]
        if pos + len(piece) > size:
            raise Transient(f"long body: more than {size} bytes")
        buf[pos:pos + len(piece)] = piece
        pos += len(piece)

