"""Remote byte sources: any fsspec URL (S3, HTTP(S), memory, ...) read by range at a pinned version.

Invariants:
- A source pins its version when it is opened. Every ``pread`` returns bytes of exactly that
  version, or raises ``SourceError`` saying the source changed — never bytes of another
  version (how each backend pins: ``s3``, ``http``, ``generic``).
- ``version()`` reports what the source is *now* (it may differ from the pin; the engine compares).
- Transient failures are retried by ``faultfs.sources.retry``, the only retry loop.
- ``pread_stream`` tells its caller as each piece of a range lands; a retry asks only for
  what did not land yet, and what was told is never taken back.
- Thread-safe: many threads may ``pread`` at once. A source opened before a fork is not
  usable in the child.
- Secrets stay secret: ``url`` has userinfo and query values redacted; exception messages are
  built from status codes and scrubbed of every secret in the URL and in ``storage_options``;
  version tokens are ETags, version ids and dates. Credentials come from the environment, the
  shared AWS files or a named profile.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from faultfs.buffers import Pieces, alloc
from faultfs.errors import InvalidInput, SourceChanged, SourceError
from faultfs.sources.base import (
    HTTP_PROTOCOLS,
    S3_PROTOCOLS,
    SourceOptions,
    SourceVersion,
    url_protocol,
)
from faultfs.sources.filesystems import filesystem_for
from faultfs.sources.generic import GenericReader
from faultfs.sources.http import HttpReader
from faultfs.sources.objects import ObjectReader
from faultfs.sources.retry import (
    DEFAULT_RETRY,
    Changed,
    Denied,
    Failure,
    IsDirectory,
    Missing,
    RetryPolicy,
    generic_failure,
    with_retries,
)
from faultfs.sources.s3 import S3Reader
from faultfs.sources.secrets import display_url, has_redacted_credentials, scrubber_for

log = logging.getLogger("faultfs.sources")

T = TypeVar("T")

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
            self._pin = with_retries(reader.stat, retry, f"opening {self.url}")
        except Missing:
            raise InvalidInput(f"source {self.url} does not exist", errno.ENOENT) from None
        except IsDirectory:
            raise InvalidInput(f"source {self.url} is a directory, not a file", errno.EISDIR) from None
        except Denied as exc:
            raise InvalidInput(f"source {self.url} is not readable: {exc}", errno.EACCES) from None
        except Failure as exc:
            raise SourceError(self._failed(f"source {self.url} cannot be opened", exc)) from None

    @property
    def pinned(self) -> SourceVersion:
        """The version every ``pread`` reads."""
        return self._pin.version

    def version(self) -> SourceVersion:
        try:
            return with_retries(self._reader.stat, self._retry, f"stat {self.url}").version
        except (Missing, IsDirectory):
            raise SourceError(f"source {self.url} vanished") from None
        except Failure as exc:
            raise SourceError(self._failed(f"stat of source {self.url} failed", exc)) from None

    def mtime(self) -> float:
        return self._pin.mtime

    def pread(self, off: int, size: int) -> bytes:
        if off < 0 or size < 0:
            raise InvalidInput(f"negative range [{off}, +{size}) for source {self.url}")
        end = min(off + size, self._pin.size)
        if off >= end:
            return b""
        return self._retrying(lambda: self._reader.read(self._pin, off, end), off, end)

    @property
    def receives_in_pieces(self) -> bool:
        """Whether ``pread_stream`` receives into ``Pieces`` as the bytes arrive (else a
        whole range is read at once: the backend reads only whole ranges)."""
        return callable(getattr(self._reader, "read_into", None))

    def pread_stream(self, off: int, size: int, landed: Callable[[memoryview], None],
                     piece: int, *, into: memoryview | Pieces | None = None
                     ) -> memoryview | Pieces:
        """Bytes ``[off, off+size)`` (fewer at the end of the source) into one pooled buffer
        (or ``into``, at least that long: a buffer, or ``Pieces`` of ``piece`` bytes that
        are allocated as the bytes reach them), read ``piece`` bytes at a time counted from
        ``off``; ``landed(first)`` is called (on this thread) with a view of the bytes in so
        far each time a piece is in. A transient failure is retried from the last piece that
        landed, within the same bounded number of tries as ``pread``."""
        end = min(off + size, self._pin.size)
        if off < 0 or size < 0:
            raise InvalidInput(f"negative range [{off}, +{size}) for source {self.url}")
        if off >= end:
            return memoryview(b"")
        read_into = getattr(self._reader, "read_into", None)
        if read_into is None:  # a backend that only reads whole ranges: one piece
            data = memoryview(self.pread(off, end - off))
            if isinstance(into, memoryview):  # (``Pieces`` only ask to hold less)
                into[:len(data)] = data
                data = into[:len(data)]
            landed(data)
            return data
        buf = alloc(end - off) if into is None else into[:end - off]
        done = 0

        def told(n: int, base: int) -> None:
            nonlocal done
            done = base + n
            landed(buf[:done])

        def attempt() -> None:
            base = done
            read_into(self._pin, off + base, end, buf[base:], lambda n: told(n, base), piece)

        self._retrying(attempt, off, end)
        return buf

    def _retrying(self, call: Callable[[], T], off: int, end: int) -> T:
        span = f"[{off}, {end})"
        try:
            return with_retries(call, self._retry, f"reading {self.url} {span}")
        except (Changed, Missing) as exc:
            if not self._change_logged:
                self._change_logged = True
                log.warning("source %s changed since it was opened (%s): %s",
                            self.url, self._pin.version.describe(), exc)
            raise SourceChanged(
                f"source {self.url} changed since it was opened "
                f"(pinned {self._pin.version.describe()}): {exc}"
            ) from None
        except Failure as exc:
            raise SourceError(self._failed(f"reading source {self.url} {span} failed", exc)) from None

    def close(self) -> None:
        """Nothing to release: the file system and its connection pool are shared."""

    @staticmethod
    def _failed(prefix: str, exc: Failure) -> str:
        after = f" after {exc.tries} tries" if exc.transient and exc.tries > 1 else ""
        return f"{prefix}{after}: {exc}"


def open_fsspec_source(
    url: str, options: SourceOptions, *, retry: RetryPolicy | None = None
) -> FsspecSource:
    """Open a non-local URL for pinned range reads. InvalidInput when it cannot be a source."""
    if has_redacted_credentials(url):  # a persisted context whose URL carried credentials
        raise InvalidInput(
            f"source {display_url(url)} was registered with credentials in its URL (userinfo "
            "or a presigned query), which faultfs never stores: give the full URL again to "
            "mount it, or use credentials from the environment", errno.EACCES)
    fs, path = filesystem_for(url, options)
    scrub = scrubber_for(url, options.storage_options)
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
    fs, path = filesystem_for(pattern, options)
    scrub = scrubber_for(pattern, options.storage_options)
    shown = display_url(pattern)

    def glob() -> dict:
        try:
            return fs.glob(path, detail=True)
        except Exception as exc:
            failure = generic_failure(exc, scrub)
            if isinstance(failure, Missing):
                return {}
            raise failure from None

    try:
        matches = with_retries(glob, retry or DEFAULT_RETRY, f"glob {shown}")
    except Denied as exc:
        raise InvalidInput(f"source glob {shown} cannot be listed: {exc}", errno.EACCES) from None
    except Failure as exc:
        raise SourceError(FsspecSource._failed(f"source glob {shown} failed", exc)) from None
    files = sorted(name for name, info in matches.items() if info.get("type") == "file")
    if not files:
        raise InvalidInput(f"source glob {shown} matches no file", errno.ENOENT)
    return [fs.unstrip_protocol(name) for name in files]
