"""Retries of remote requests: classified failures, the retry policy, and the one retry loop.

Invariants:
- A backend raises only ``Failure`` subclasses; their text is already free of secrets.
- Transient failures (timeouts, connection errors, 5xx, throttling) are retried with exponential
  backoff and full jitter, at most ``RetryPolicy.attempts`` tries in all; anything else
  (missing, denied, changed) fails at once. The libraries' own retry loops are switched off
  (``faultfs.sources.filesystems``) so that this loop is the only bound.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger("faultfs.sources")

T = TypeVar("T")

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


class Failure(Exception):
    """One request's failure, classified; its text is already free of secrets."""

    transient = False
    tries = 1  # how many tries ended in this failure (set by the retry loop)


class Transient(Failure):
    transient = True


class Missing(Failure):
    pass


class Denied(Failure):
    pass


class Changed(Failure):
    pass


class IsDirectory(Failure):
    pass


class Permanent(Failure):
    pass


def transport_failure(exc: BaseException, scrub: Callable[[str], str]) -> Failure | None:
    """Network-level failures shared by every backend: all transient. None when not one."""
    import http.client

    import aiohttp
    import botocore.exceptions as bexc
    import urllib3.exceptions

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
        http.client.HTTPException,  # a body read straight from its socket (``sources.s3``)
        urllib3.exceptions.HTTPError,
    )
    if isinstance(exc, transient_types):
        return Transient(scrub(f"{type(exc).__name__}: {exc}".rstrip(": ")))
    return None


def generic_failure(exc: BaseException, scrub: Callable[[str], str]) -> Failure:
    """Classify an exception from an arbitrary fsspec implementation."""
    if isinstance(exc, Failure):
        return exc
    transport = transport_failure(exc, scrub)
    if transport is not None:
        return transport
    if isinstance(exc, FileNotFoundError):
        return Missing("not found")
    if isinstance(exc, IsADirectoryError):
        return IsDirectory("is a directory")
    if isinstance(exc, PermissionError):
        return Denied("access denied")
    if isinstance(exc, OSError) and exc.errno in (
        errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EAGAIN,
    ):
        return Transient(scrub(f"{type(exc).__name__}: {exc}"))
    return Permanent(scrub(f"{type(exc).__name__}: {exc}"))


def with_retries(call: Callable[[], T], retry: RetryPolicy, what: str) -> T:
    """Run ``call``; retry transient ``Failure``s; the last failure carries ``tries``."""
    attempts = max(1, retry.attempts)
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Failure as failure:
            failure.tries = attempt
            if not failure.transient or attempt == attempts:
                raise
            delay = retry.delay(attempt - 1)
            log.debug("%s: %s; retry %d/%d in %.3f s", what, failure, attempt, attempts - 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover

