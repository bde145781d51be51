"""Globs: source patterns expanded, in sorted order, to the files they match (local or remote).

A ``?`` that starts an HTTP query or an S3 ``?versionId=`` is not a wildcard.
"""

from __future__ import annotations

import errno
import glob
import os

from faultfs.errors import InvalidInput
from faultfs.sources.base import SourceOptions, check_url, local_path


def expand_sources(patterns: list[str], options: SourceOptions | None = None) -> list[str]:
    """Expand globs (``*``, ``?``, ``[``) in sorted order; plain names pass through."""
    out: list[str] = []
    for pattern in patterns:
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        path = local_path(pattern)
        if path is not None:
            matches = sorted(glob.glob(path))
            prefix = pattern[: len(pattern) - len(path)]
            files = [m for m in matches if os.path.isfile(m)]
            if not files:
                raise InvalidInput(f"source glob {pattern} matches no file", errno.ENOENT)
            out.extend(prefix + m for m in files)
        else:
            from faultfs.sources.remote import expand_fsspec_glob  # fsspec: only when needed

            check_url(pattern)
            out.extend(expand_fsspec_glob(pattern, options or SourceOptions()))
    return out
