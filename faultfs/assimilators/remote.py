"""Remote byte sources: any fsspec URL (S3, HTTP(S), memory, ...) read by range at a pinned version.

Invariants:
- A source pins its version when it is opened. Every ``pread`` returns bytes of exactly that
  version, or raises ``SourceError`` saying the source changed — never bytes of another version:
  - S3, versioned object: each read names the pinned ``VersionId``, so the pinned version keeps
    being served after an overwrite (until that version is deleted);
  - S3, unversioned object: each read carries ``If-Match: <pinned ETag>``, and the response's
    ETag and total size (``Content-Range``) are checked too, for servers that ignore ``If-Match``;
  - HTTP(S): ``If-Match`` on a strong ETag (else ``If-Unmodified-Since`` on Last-Modified), and the
    response's ETag / Last-Modified and ``Content-Range`` total are checked;
  - any other fsspec file system: read, then stat again; a changed size or version token fails
    the read (stat-after-read also catches a change in the middle of the read).
- ``version()`` reports what the source is *now* (it may differ from the pin; the engine compares).
- Transient failures (timeouts, connection errors, 5xx, throttling) are retried with exponential
  backoff and full jitter, at most ``RetryPolicy.attempts`` tries in all; anything else (missing,
  denied, changed) fails at once. The libraries' own retry loops are switched off so that this
  is the only bound.
- Thread-safe: many threads may ``pread`` at once. Async file systems (s3fs, HTTP) run each
  request on fsspec's I/O event loop; synchronous ones are called under one lock per file system.
  File-system instances are shared per (protocol, resolved options, process); a source opened
  before a fork is not usable in the child.
- Secrets stay secret: ``url`` has userinfo and query values redacted; exception messages are
  built from status codes and scrubbed of every secret in the URL and in ``storage_options``;
  version tokens are ETags, version ids and dates. Credentials come from the environment, the
  shared AWS files or a named profile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import random
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from http import HTTPStatus
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, quote, unquote_plus, urlsplit, urlunsplit

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.utils import tokenize

from faultfs.assimilators.sources import S3_PROTOCOLS, SourceOptions, SourceVersion, url_protocol
from faultfs.buffers import alloc
from faultfs.errors import InvalidInput, SourceError

log = logging.getLogger(__name__)

T = TypeVar("T")

HTTP_PROTOCOLS = ("http", "https")

# The engine runs up to 32 faults at once (FAULTFS_IO_THREADS); the HTTP pool must never queue
# them, and glob/stat calls from registration come on top.
MAX_POOL_CONNECTIONS = 64
# A loopback or in-region endpoint connects in milliseconds; 5 s means the endpoint is gone.
CONNECT_TIMEOUT_S = 5.0
# No bytes for 15 s on an open connection: give up on this try and let the retry loop decide
# (the same values s3fs uses by default).
READ_TIMEOUT_S = 15.0
BODY_PIECE = 512 << 10  # an S3 body is copied into its buffer in pieces of up to this
# Query parameters that name an object version rather than grant access: shown, not redacted.
PUBLIC_QUERY_KEYS = frozenset({"versionId"})
# Option names under which storage_options may carry credentials (matched case-insensitively).
SECRET_OPTION_NAME = re.compile(r"key|secret|token|passw|credential|auth|signature|session", re.I)
# Query parameter names that carry credentials: presigned S3 (X-Amz-Signature, X-Amz-Credential,
# X-Amz-Security-Token; SigV2 AWSAccessKeyId, Signature), GCS (X-Goog-*), Azure SAS (sig),
# CloudFront (Signature, Key-Pair-Id), OAuth (access_token). Case-insensitive.
CREDENTIAL_QUERY_NAME = re.compile(
    r"key|secret|token|passw|credential|auth|signature|session|^sig$", re.I)
REDACTED = "***"  # what stands in for a secret in a persisted source URL
# S3 error codes that mean "try again later" even when the status is not 5xx.
S3_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
    "RequestThrottled", "RequestTimeout", "RequestTimeoutException", "ServiceUnavailable",
    "InternalError", "BandwidthLimitExceeded", "TooManyRequestsException",
})
# HTTP statuses worth retrying: request timeout, too many requests, and every 5xx.
HTTP_TRANSIENT_STATUSES = frozenset({408, 429})


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried (exponential, full jitter).

    The defaults ride out a throttling burst or a dropped connection — at most 0.2+0.4+0.8+1.6 s
    of sleep over 5 tries — without holding a reader for minutes when the endpoint is down.
    """

    attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def delay(self, retry: int) -> float:
        """Seconds to sleep before retry number ``retry`` (0-based): uniform in [0, cap]."""
        return random.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2**retry)))


DEFAULT_RETRY = RetryPolicy()


# --- classified failures (internal; the public surface raises InvalidInput / SourceError) ---


class _Failure(Exception):
    """One request's failure, classified; its text is already free of secrets."""

    transient = False
    tries = 1  # how many tries ended in this failure (set by the retry loop)


class _Transient(_Failure):
    transient = True


class _Missing(_Failure):
    pass


class _Denied(_Failure):
    pass


class _Changed(_Failure):
    pass


class _IsDirectory(_Failure):
    pass


class _Permanent(_Failure):
    pass


def _transport_failure(exc: BaseException, scrub: Callable[[str], str]) -> _Failure | None:
    """Network-level failures shared by every backend: all transient. None when not one."""
    import aiohttp
    import botocore.exceptions as bexc

    transient_types: tuple[type[BaseException], ...] = (
        bexc.ConnectionError,
        bexc.HTTPClientError,
        bexc.IncompleteReadError,
        aiohttp.ClientConnectionError,
        aiohttp.ClientPayloadError,
        asyncio.TimeoutError,
        TimeoutError,
        ConnectionError,
        asyncio.IncompleteReadError,
    )
    if isinstance(exc, transient_types):
        return _Transient(scrub(f"{type(exc).__name__}: {exc}".rstrip(": ")))
    return None


def _generic_failure(exc: BaseException, scrub: Callable[[str], str]) -> _Failure:
    """Classify an exception from an arbitrary fsspec implementation."""
    if isinstance(exc, _Failure):
        return exc
    transport = _transport_failure(exc, scrub)
    if transport is not None:
        return transport
    if isinstance(exc, FileNotFoundError):
        return _Missing("not found")
    if isinstance(exc, IsADirectoryError):
        return _IsDirectory("is a directory")
    if isinstance(exc, PermissionError):
        return _Denied("access denied")
    if isinstance(exc, OSError) and exc.errno in (
        errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EAGAIN,
    ):
        return _Transient(scrub(f"{type(exc).__name__}: {exc}"))
    return _Permanent(scrub(f"{type(exc).__name__}: {exc}"))


# --- secrets ---


class _Scrubber:
    """Replaces every known secret string in a text with ``***``."""

    def __init__(self, secrets: Iterable[str]) -> None:
        found: set[str] = set()
        for s in secrets:
            if len(s) >= 4:  # shorter values are not credentials, and would mangle every message
                found.update({s, quote(s, safe=""), quote(s)})
        self._secrets = sorted(found, key=len, reverse=True)

    def __call__(self, text: str) -> str:
        for s in self._secrets:
            text = text.replace(s, "***")
        return text


def _option_secrets(value: Any, secret_branch: bool = False) -> Iterable[str]:
    """Strings in ``storage_options`` that sit under a credential-like name."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _option_secrets(v, secret_branch or bool(SECRET_OPTION_NAME.search(str(k))))
    elif isinstance(value, (list, tuple, set)):
        for v in value:
            yield from _option_secrets(v, secret_branch)
    elif secret_branch and value is not None and not isinstance(value, bool):
        yield str(value)


def _url_secrets(url: str) -> list[str]:
    if "://" not in url:
        return []
    parts = urlsplit(url)
    out = [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in PUBLIC_QUERY_KEYS]
    out += [parts.username or "", parts.password or ""]
    return [s for s in out if s]


def display_url(url: str) -> str:
    """``url`` with userinfo dropped and query values (except ``versionId``) shown as ``***``."""
    if "://" not in url:
        return url
    parts = urlsplit(url)
    if "@" not in parts.netloc and not parts.query:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    query = "&".join(
        f"{k}={v if k in PUBLIC_QUERY_KEYS else '***'}"
        for k, v in parse_qsl(parts.query, keep_blank_values=True)
    )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def persistable_src(url: str) -> str:
    """``url`` as a fault context may persist it: userinfo and the values of credential-like
    query parameters (a presigned URL's signature, credential, security token; a SAS ``sig``)
    replaced by ``***``, everything else kept byte for byte. A URL without them is unchanged.

    Unlike ``display_url``, other query values stay: they say which object the URL names, and
    the context's key must tell two such URLs apart. (A URL presigned again usually differs in
    its date parameters too, so it makes a new context.)
    """
    if "://" not in url:
        return url
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{REDACTED}@{netloc.rpartition('@')[2]}"
    query = "&".join(_redact_param(p) for p in parts.query.split("&")) if parts.query else ""
    if (netloc, query) == (parts.netloc, parts.query):
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def has_redacted_credentials(url: str) -> bool:
    """True for a URL whose credentials ``persistable_src`` replaced: it cannot be opened."""
    if "://" not in url:
        return False
    parts = urlsplit(url)
    if parts.netloc.rpartition("@")[0] == REDACTED:
        return True
    params = (p.partition("=") for p in parts.query.split("&")) if parts.query else ()
    return any(value == REDACTED and _is_credential_param(name) for name, _, value in params)


def _is_credential_param(name: str) -> bool:
    name = unquote_plus(name)
    return name not in PUBLIC_QUERY_KEYS and CREDENTIAL_QUERY_NAME.search(name) is not None


def _redact_param(param: str) -> str:
    name, sep, _ = param.partition("=")
    return f"{name}={REDACTED}" if sep and _is_credential_param(name) else param


# --- file systems: one per (protocol, resolved options), shared by all sources ---

_FS_LOCK = threading.Lock()
_FILESYSTEMS: dict[str, fsspec.AbstractFileSystem] = {}
_SYNC_LOCKS: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()


def s3_filesystem_kwargs(options: SourceOptions, environ: dict[str, str] | None = None) -> dict:
    """s3fs constructor arguments from the context fields, the AWS environment and storage_options.

    botocore (installed version) already honours AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL,
    ``endpoint_url`` in the shared config, AWS_PROFILE, AWS_DEFAULT_REGION and the shared
    config/credential files. Filled in here: ``s3_endpoint_url`` > AWS_ENDPOINT_URL_S3 >
    AWS_ENDPOINT_URL resolved explicitly (so the shared file-system instance is keyed by it),
    AWS_REGION (which botocore does not read) after ``s3_region``, and ``s3_profile``.
    """
    env = os.environ if environ is None else environ
    kwargs: dict[str, Any] = {
        "anon": options.anon,
        "use_listings_cache": False,  # a listing cache would hide a changed object
        "skip_instance_cache": True,  # this instance is tuned (retries off); do not share it
        "config_kwargs": {
            "max_pool_connections": MAX_POOL_CONNECTIONS,
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"total_max_attempts": 1},  # RetryPolicy is the only retry loop
        },
    }
    endpoint = options.s3_endpoint_url
    if not endpoint and env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").lower() != "true":
        endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or ""
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    region = options.s3_region or env.get("AWS_REGION", "")
    if region:
        kwargs["client_kwargs"] = {"region_name": region}
    if options.s3_profile:
        kwargs["profile"] = options.s3_profile
    for name, value in options.storage_options.items():
        if name in ("config_kwargs", "client_kwargs") and isinstance(value, dict):
            kwargs[name] = {**kwargs.get(name, {}), **value}
        else:
            kwargs[name] = value
    return kwargs


def http_filesystem_kwargs(options: SourceOptions) -> dict:
    import aiohttp

    kwargs: dict[str, Any] = {
        "skip_instance_cache": True,
        "client_kwargs": {
            "timeout": aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S
            ),
        },
    }
    for name, value in options.storage_options.items():
        if name == "client_kwargs" and isinstance(value, dict):
            kwargs[name] = {**kwargs[name], **value}
        else:
            kwargs[name] = value
    return kwargs


def _shared_filesystem(protocol: str, kwargs: dict) -> fsspec.AbstractFileSystem:
    # the pid: an async file system is bound to its parent's event loop and refuses to work
    # after a fork, so a forked daemon builds its own
    key = tokenize(protocol, kwargs, os.getpid())
    with _FS_LOCK:
        fs = _FILESYSTEMS.get(key)
        if fs is None:
            fs = fsspec.filesystem(protocol, **kwargs)
            if protocol in S3_PROTOCOLS:
                fs.retries = 1  # s3fs's own retry loop off (glob/list): RetryPolicy bounds tries
            _FILESYSTEMS[key] = fs
        return fs


def _filesystem_for(url: str, options: SourceOptions) -> tuple[fsspec.AbstractFileSystem, str]:
    protocol = url_protocol(url)
    try:
        if protocol in S3_PROTOCOLS:
            fs = _shared_filesystem("s3", s3_filesystem_kwargs(options))
            return fs, fs._strip_protocol(url)
        if protocol in HTTP_PROTOCOLS:
            return _shared_filesystem("http", http_filesystem_kwargs(options)), url
        kwargs = {"use_listings_cache": False, **options.storage_options}
        return fsspec.url_to_fs(url, **kwargs)
    except ImportError as exc:
        raise InvalidInput(
            f"source {display_url(url)} needs a package that is not installed: {exc}"
        ) from None
    except ValueError as exc:
        raise InvalidInput(f"source {display_url(url)} is not a usable URL: {exc}") from None


def _sync_lock(fs: Any) -> threading.Lock:
    with _FS_LOCK:
        lock = _SYNC_LOCKS.get(fs)
        if lock is None:
            lock = _SYNC_LOCKS[fs] = threading.Lock()
        return lock


def clear_filesystems() -> None:
    """Forget the shared file-system instances (tests; a process that changes its AWS setup)."""
    with _FS_LOCK:
        _FILESYSTEMS.clear()


# --- what a backend reports, and how it reads ---


@dataclass(frozen=True)
class ObjectStat:
    """An object's identity at one moment: size, version token and what pins a read to it."""

    size: int
    token: str  # "vid:<id>", "etag:<etag>", "lastmod:<date>", "<field>:<value>", "unpinned"
    mtime: float
    etag: str = ""  # as the server sends it, quotes included
    version_id: str = ""
    last_modified: str = ""  # HTTP date, for If-Unmodified-Since

    @property
    def version(self) -> SourceVersion:
        return SourceVersion(self.size, self.token)


class ObjectReader(Protocol):
    """One object on one backend. Raises only ``_Failure`` subclasses."""

    def stat(self) -> ObjectStat: ...

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes: ...


def _content_range(value: str) -> tuple[int | None, int | None]:
    """(first byte, total size) of ``bytes a-b/total`` or ``bytes */total``; None where absent."""
    m = re.fullmatch(r"\s*bytes\s+(?:(\d+)-\d+|\*)/(\d+|\*)\s*", value or "")
    if not m:
        return None, None
    first = int(m.group(1)) if m.group(1) is not None else None
    total = int(m.group(2)) if m.group(2) != "*" else None
    return first, total


def _status_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "error"


def _strong_etag(etag: str) -> bool:
    return bool(etag) and not etag.startswith("W/")


def _etag_core(etag: str) -> str:
    return etag.removeprefix("W/").strip('"')


class S3Reader:
    """An S3 object, read with the aiobotocore client of a shared s3fs instance."""

    def __init__(self, fs: Any, path: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._scrub = scrub
        path, _, self._version_id = path.partition("?versionId=")
        self._bucket, _, self._key = path.partition("/")

    def _classify(self, exc: BaseException) -> _Failure:
        from botocore.exceptions import ClientError, NoCredentialsError

        if isinstance(exc, _Failure):
            return exc
        if isinstance(exc, NoCredentialsError):
            return _Denied("no AWS credentials found (set AWS_PROFILE or AWS_ACCESS_KEY_ID, "
                           "or use --anon for a public bucket)")
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if not code or code == str(status):  # a HEAD answer has no body to name the error
                code = _status_phrase(status)
            what = self._scrub(f"{code} (HTTP {status})")
            if code == "PreconditionFailed" or status == 412:
                return _Changed("its ETag no longer matches the pinned one")
            if code == "InvalidRange" or status == 416:
                return _Changed("the range is past its current end")
            if code == "NoSuchVersion":
                return _Missing("the pinned version was deleted")
            if code in ("NoSuchKey", "NoSuchBucket", "NotFound", "404") or status == 404:
                return _Missing(what)
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId",
                                                 "SignatureDoesNotMatch", "ExpiredToken"):
                return _Denied(what)
            if status >= 500 or status in HTTP_TRANSIENT_STATUSES or code in S3_TRANSIENT_CODES:
                return _Transient(what)
            return _Permanent(what)
        return _transport_failure(exc, self._scrub) or _Permanent(
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
                    raise _IsDirectory("is a directory")
                raise _Missing("no such object")
            kw = {"VersionId": self._version_id} if self._version_id else {}
            try:
                out = await s3.head_object(Bucket=self._bucket, Key=self._key, **kw)
            except Exception as exc:
                failure = self._classify(exc)
                if isinstance(failure, _Missing) and not self._version_id:
                    if await self._is_prefix(s3, self._key + "/"):
                        raise _IsDirectory("is a directory") from None
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
            if isinstance(failure, _Missing):
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
                data = await _read_body(body, end - start)
            finally:
                body.close()
        except Exception as exc:
            raise self._classify(exc) from None
        etag = resp.get("ETag", "")
        if pin.etag and etag and _etag_core(etag) != _etag_core(pin.etag):
            raise _Changed(f"its ETag is now {etag}")
        _, total = _content_range(resp.get("ContentRange", ""))
        if total is not None and total != pin.size:
            raise _Changed(f"its size is now {total}")
        if len(data) != end - start:
            raise _Transient(f"short body: {len(data)} of {end - start} bytes")
        return data


async def _read_body(body, size: int) -> memoryview:
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
            raise _Transient(f"long body: more than {size} bytes")
        buf[pos:pos + len(piece)] = piece
        pos += len(piece)


class HttpReader:
    """An HTTP(S) resource read with 206 range requests on a shared aiohttp session."""

    def __init__(self, fs: Any, url: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._url = url
        self._scrub = scrub

    def _status_failure(self, status: int) -> _Failure:
        what = f"HTTP {status} {_status_phrase(status)}"
        if status in (404, 410):
            return _Missing(what)
        if status in (401, 403):
            return _Denied(what)
        if status >= 500 or status in HTTP_TRANSIENT_STATUSES:
            return _Transient(what)
        return _Permanent(what)

    def _classify(self, exc: BaseException) -> _Failure:
        if isinstance(exc, _Failure):
            return exc
        return _transport_failure(exc, self._scrub) or _Permanent(
            self._scrub(f"{type(exc).__name__}: {exc}")
        )

    async def _request(self, method: str, headers: dict[str, str]) -> Any:
        session = await self._fs.set_session()
        kw = dict(self._fs.kwargs)
        # identity: a compressed body's byte ranges are not the resource's byte ranges
        merged = {**kw.pop("headers", {}), "Accept-Encoding": "identity", **headers}
        return session.request(method, self._fs.encode_url(self._url), headers=merged, **kw)

    def stat(self) -> ObjectStat:
        return sync(self._fs.loop, self._stat)

    async def _stat(self) -> ObjectStat:
        try:
            async with await self._request("HEAD", {}) as r:
                size = r.headers.get("Content-Length")
                if r.status == 200 and size is not None:
                    return self._stat_from(int(size), r.headers)
                # 401/403 too: a presigned URL is signed for GET only, so S3 refuses its HEAD
                if r.status not in (200, 401, 403, 405, 501):
                    raise self._status_failure(r.status)
            # HEAD refused or without a length: ask for the first byte and read the total
            async with await self._request("GET", {"Range": "bytes=0-0"}) as r:
                if r.status in (206, 416):
                    _, total = _content_range(r.headers.get("Content-Range", ""))
                elif r.status == 200:
                    total = r.content_length
                else:
                    raise self._status_failure(r.status)
                if total is None:
                    raise _Permanent("the server reports no size for it")
                return self._stat_from(total, r.headers)
        except Exception as exc:
            raise self._classify(exc) from None

    @staticmethod
    def _stat_from(size: int, headers: Any) -> ObjectStat:
        etag = headers.get("ETag", "")
        last_modified = headers.get("Last-Modified", "")
        mtime = time.time()
        if last_modified:
            try:
                mtime = parsedate_to_datetime(last_modified).timestamp()
            except (TypeError, ValueError):
                last_modified = ""
        if etag:
            token = f"etag:{etag}"
        elif last_modified:
            token = f"lastmod:{last_modified}"
        else:
            token = "unpinned"
        return ObjectStat(size, token, mtime, etag=etag, last_modified=last_modified)

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes | memoryview:
        return sync(self._fs.loop, self._read, pin, start, end)

    async def _read(self, pin: ObjectStat, start: int, end: int) -> bytes | memoryview:
        headers = {"Range": f"bytes={start}-{end - 1}"}
        if _strong_etag(pin.etag):
            headers["If-Match"] = pin.etag
        elif pin.last_modified and not pin.etag:
            headers["If-Unmodified-Since"] = pin.last_modified
        try:
            async with await self._request("GET", headers) as r:
                if r.status == 412:
                    raise _Changed("its validator no longer matches the pinned one (HTTP 412)")
                if r.status == 416:
                    raise _Changed("the range is past its current end (HTTP 416)")
                if r.status not in (200, 206):
                    raise self._status_failure(r.status)
                etag = r.headers.get("ETag", "")
                if pin.etag and etag and _etag_core(etag) != _etag_core(pin.etag):
                    raise _Changed(f"its ETag is now {etag}")
                last_modified = r.headers.get("Last-Modified", "")
                if not pin.etag and pin.last_modified and last_modified and (
                    last_modified != pin.last_modified
                ):
                    raise _Changed(f"it was modified at {last_modified}")
                if r.status == 206:
                    first, total = _content_range(r.headers.get("Content-Range", ""))
                    if total is not None and total != pin.size:
                        raise _Changed(f"its size is now {total}")
                    if first != start:
                        raise _Permanent(f"the server answered a different range ({first})")
                    data = await r.read()
                else:  # 200: the server ignored Range and sends the whole resource
                    if r.content_length is not None and r.content_length != pin.size:
                        raise _Changed(f"its size is now {r.content_length}")
                    if start != 0:
                        raise _Permanent("the server does not honour Range requests")
                    data = await r.content.readexactly(end)
        except Exception as exc:
            raise self._classify(exc) from None
        if len(data) != end - start:
            raise _Transient(f"short body: {len(data)} of {end - start} bytes")
        return data


# info fields that identify a version, strongest first
_VERSION_FIELDS = (
    "VersionId", "generation", "ETag", "etag", "md5Hash", "md5", "checksum",
    "mtime", "LastModified", "last_modified", "updated", "modified", "created",
)
_MTIME_FIELDS = ("mtime", "LastModified", "last_modified", "updated", "modified", "created")


def _as_timestamp(value: Any) -> float | None:
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


class GenericReader:
    """Any other fsspec file system: ``cat_file`` by range, verified by a stat after the read."""

    def __init__(self, fs: Any, path: str, scrub: Callable[[str], str]) -> None:
        self._fs = fs
        self._path = path
        self._scrub = scrub
        # async implementations serialise on their own loop; sync ones promise no thread safety
        self._lock = None if isinstance(fs, AsyncFileSystem) else _sync_lock(fs)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            if self._lock is None:
                return fn()
            with self._lock:
                return fn()
        except Exception as exc:
            raise _generic_failure(exc, self._scrub) from None

    def stat(self) -> ObjectStat:
        def info() -> dict:
            self._fs.invalidate_cache(self._path)
            return self._fs.info(self._path)

        info_ = self._call(info)
        if info_.get("type") == "directory":
            raise _IsDirectory("is a directory")
        if info_.get("size") is None:
            raise _Permanent("the file system reports no size for it")
        token = "unpinned"
        for name in _VERSION_FIELDS:
            value = info_.get(name)
            if value not in (None, ""):
                shown = value.isoformat() if isinstance(value, datetime) else value
                token = f"{name}:{shown}"
                break
        mtime = next(
            (t for t in (_as_timestamp(info_.get(n)) for n in _MTIME_FIELDS) if t is not None),
            time.time(),
        )
        return ObjectStat(int(info_["size"]), token, mtime)

    def read(self, pin: ObjectStat, start: int, end: int) -> bytes:
        data = self._call(lambda: self._fs.cat_file(self._path, start=start, end=end))
        now = self.stat()
        if (now.size, now.token) != (pin.size, pin.token):
            raise _Changed(f"it is now {now.version.describe()}")
        if len(data) != end - start:
            raise _Transient(f"short read: {len(data)} of {end - start} bytes")
        return data


def _with_retries(call: Callable[[], T], retry: RetryPolicy, what: str) -> T:
    """Run ``call``; retry transient ``_Failure``s; the last failure carries ``tries``."""
    attempts = max(1, retry.attempts)
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except _Failure as failure:
            failure.tries = attempt
            if not failure.transient or attempt == attempts:
                raise
            delay = retry.delay(attempt - 1)
            log.debug("%s: %s; retry %d/%d in %.3f s", what, failure, attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


class FsspecSource:
    """A remote object read by range at the version it had when opened (see module invariants)."""

    def __init__(
        self,
        url: str,
        reader: ObjectReader,
        retry: RetryPolicy = DEFAULT_RETRY,
    ) -> None:
        self.url = display_url(url)
        self._reader = reader
        self._retry = retry
        self._change_logged = False
        try:
            self._pin = _with_retries(reader.stat, retry, f"opening {self.url}")
        except _Missing:
            raise InvalidInput(f"source {self.url} does not exist", errno.ENOENT) from None
        except _IsDirectory:
            raise InvalidInput(f"source {self.url} is a directory, not a file", errno.EISDIR) from None
        except _Denied as exc:
            raise InvalidInput(f"source {self.url} is not readable: {exc}", errno.EACCES) from None
        except _Failure as exc:
            raise SourceError(self._failed(f"source {self.url} cannot be opened", exc)) from None

    @property
    def pinned(self) -> SourceVersion:
        """The version every ``pread`` reads."""
        return self._pin.version

    def version(self) -> SourceVersion:
        try:
            return _with_retries(self._reader.stat, self._retry, f"stat {self.url}").version
        except (_Missing, _IsDirectory):
            raise SourceError(f"source {self.url} vanished") from None
        except _Failure as exc:
            raise SourceError(self._failed(f"stat of source {self.url} failed", exc)) from None

    def mtime(self) -> float:
        return self._pin.mtime

    def pread(self, off: int, size: int) -> bytes:
        if off < 0 or size < 0:
            raise InvalidInput(f"negative range [{off}, +{size}) for source {self.url}")
        end = min(off + size, self._pin.size)
        if off >= end:
            return b""
        span = f"[{off}, {end})"
        try:
            return _with_retries(
                lambda: self._reader.read(self._pin, off, end), self._retry,
                f"reading {self.url} {span}",
            )
        except (_Changed, _Missing) as exc:
            if not self._change_logged:
                self._change_logged = True
                log.warning("source %s changed since it was opened (%s): %s",
                            self.url, self._pin.version.describe(), exc)
            raise SourceError(
                f"source {self.url} changed since it was opened "
                f"(pinned {self._pin.version.describe()}): {exc}"
            ) from None
        except _Failure as exc:
            raise SourceError(self._failed(f"reading source {self.url} {span} failed", exc)) from None

    def close(self) -> None:
        """Nothing to release: the file system and its connection pool are shared."""

    @staticmethod
    def _failed(prefix: str, exc: _Failure) -> str:
        after = f" after {exc.tries} tries" if exc.transient and exc.tries > 1 else ""
        return f"{prefix}{after}: {exc}"


def _scrubber(url: str, options: SourceOptions) -> _Scrubber:
    return _Scrubber([*_url_secrets(url), *_option_secrets(options.storage_options)])


def open_fsspec_source(
    url: str, options: SourceOptions, *, retry: RetryPolicy | None = None
) -> FsspecSource:
    """Open a non-local URL for pinned range reads. InvalidInput when it cannot be a source."""
    if has_redacted_credentials(url):  # a persisted context whose URL carried credentials
        raise InvalidInput(
            f"source {display_url(url)} was registered with credentials in its URL (userinfo "
            "or a presigned query), which faultfs never stores: give the full URL again to "
            "mount it, or use credentials from the environment", errno.EACCES)
    fs, path = _filesystem_for(url, options)
    scrub = _scrubber(url, options)
    protocol = url_protocol(url)
    reader: ObjectReader
    if protocol in S3_PROTOCOLS:
        reader = S3Reader(fs, path, scrub)
    elif protocol in HTTP_PROTOCOLS:
        reader = HttpReader(fs, path, scrub)
    else:
        reader = GenericReader(fs, path, scrub)
    return FsspecSource(url, reader, retry or DEFAULT_RETRY)


def expand_fsspec_glob(
    pattern: str, options: SourceOptions, *, retry: RetryPolicy | None = None
) -> list[str]:
    """Expand a remote glob to full URLs of files, in sorted order; InvalidInput if none match.

    A ``?`` that starts an HTTP query or an S3 ``?versionId=`` is not a wildcard: such a URL
    without ``*`` or ``[`` is returned as it is.
    """
    protocol = url_protocol(pattern)
    if protocol in HTTP_PROTOCOLS or (protocol in S3_PROTOCOLS and "?versionId=" in pattern):
        if not any(c in urlsplit(pattern).path for c in "*["):
            return [pattern]
    fs, path = _filesystem_for(pattern, options)
    scrub = _scrubber(pattern, options)
    shown = display_url(pattern)

    def glob() -> dict:
        try:
            return fs.glob(path, detail=True)
        except Exception as exc:
            failure = _generic_failure(exc, scrub)
            if isinstance(failure, _Missing):
                return {}
            raise failure from None

    try:
        matches = _with_retries(glob, retry or DEFAULT_RETRY, f"glob {shown}")
    except _Denied as exc:
        raise InvalidInput(f"source glob {shown} cannot be listed: {exc}", errno.EACCES) from None
    except _Failure as exc:
        raise SourceError(FsspecSource._failed(f"source glob {shown} failed", exc)) from None
    files = sorted(name for name, info in matches.items() if info.get("type") == "file")
    if not files:
        raise InvalidInput(f"source glob {shown} matches no file")
    return [fs.unstrip_protocol(name) for name in files]
