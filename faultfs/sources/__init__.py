"""Transports: open a source URL (local file, S3, HTTP(S), any fsspec URL), pin its version, read
exact byte ranges with bounded retries, keep secrets out of messages and the store; globs.

The mount (through the assimilators) and the record streams both read through here. Remote
support (fsspec, s3fs, aiohttp) is imported only when a remote URL is opened.
"""

from __future__ import annotations

from faultfs.errors import InvalidInput
from faultfs.sources.base import (
    HTTP_PROTOCOLS,
    S3_PROTOCOLS,
    Source,
    SourceOptions,
    SourceVersion,
    check_url,
    local_path,
    url_protocol,
)
from faultfs.sources.globs import expand_sources
from faultfs.sources.local import LocalFileSource

__all__ = [
    "HTTP_PROTOCOLS", "S3_PROTOCOLS", "LocalFileSource", "Source", "SourceOptions",
    "SourceVersion", "expand_sources", "local_path", "open_source", "persistable_src",
    "url_protocol",
]


def open_source(url: str, options: SourceOptions | None = None) -> Source:
    """Open ``url`` for range reads. Raises InvalidInput when it cannot be a source."""
    path = local_path(url)
    if path is not None:
        if not path:
            raise InvalidInput("source path is empty")
        return LocalFileSource(url, path, direct=(options or SourceOptions()).local_direct)
    check_url(url)
    try:
        from faultfs.sources.remote import open_fsspec_source
    except ImportError as exc:  # pragma: no cover - depends on installed extras
        raise InvalidInput(f"source {url} needs fsspec support that is not installed: {exc}") from None
    return open_fsspec_source(url, options or SourceOptions())


def persistable_src(url: str) -> str:
    """``url`` as a fault context may persist it (credentials replaced by ``***``, DESIGN §3)."""
    if local_path(url) is not None:
        return url
    from faultfs.sources.secrets import persistable_src as redact

    return redact(url)
