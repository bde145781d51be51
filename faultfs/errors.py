"""Library errors: every error a user can meet carries an errno and a one-line message.

The CLI prints ``str(err)`` and exits non-zero; the FUSE adapter replies with ``err.errno``.
Result codes kept from upstream (e.g. -20, "assimilator cannot ingest per blob") travel in
``code``.
"""

from __future__ import annotations

import errno as _errno


class FaultfsError(Exception):
    """An error with an errno (for FUSE replies) and a clear message (for people)."""

    def __init__(self, message: str, errno: int = _errno.EIO, code: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno
        self.code = code

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidInput(FaultfsError):
    """Bad input (names, ranges, sizes, pagemaps, contexts): refused, nothing changed."""

    def __init__(self, message: str, errno: int = _errno.EINVAL) -> None:
        super().__init__(message, errno)


class SourceError(FaultfsError):
    """The source could not deliver the bytes asked for (missing, changed, failing)."""

    def __init__(self, message: str, errno: int = _errno.EIO) -> None:
        super().__init__(message, errno)


class SourceChanged(SourceError):
    """The source is no longer the version the mount pinned: its bytes are not served."""


class CorruptionError(FaultfsError):
    """A persisted file (blob, checkpoint, registry entry) failed verification."""

    def __init__(self, message: str, errno: int = _errno.EIO) -> None:
        super().__init__(message, errno)


class StoreFull(FaultfsError):
    """The store's file system has no room for a blob (ENOSPC or the reserve line)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, _errno.ENOSPC)


# Upstream result code: registering on-fault against an assimilator whose blob_bytes is 0.
RC_CANNOT_INGEST_PER_BLOB = -20
