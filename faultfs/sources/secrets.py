"""Secrets stay secret: URL redaction for display and persistence, and scrubbing of messages.

Invariants:
- ``display_url`` drops userinfo and shows every query value but ``versionId`` as ``***``.
- ``persistable_src`` replaces userinfo and credential-like query values with ``***`` and keeps
  everything else byte for byte, so a persisted context never holds a secret yet still names
  its object; ``has_redacted_credentials`` tells such a URL apart (it cannot be opened).
- ``Scrubber`` replaces every known secret (from the URL and from ``storage_options``) in a
  text, in plain and percent-encoded form.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, quote, unquote_plus, urlsplit, urlunsplit

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


class Scrubber:
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
    if "://" not in url or ("@" not in url and "?" not in url):
        return url  # no userinfo, no query: nothing to hide (and no parse)
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
    if "://" not in url or ("@" not in url and "?" not in url):
        return url  # no userinfo, no query: nothing to redact (and no parse)
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


def scrubber_for(url: str, storage_options: dict) -> Scrubber:
    """A scrubber of every secret in ``url`` and under credential-like names in the options."""
    return Scrubber([*_url_secrets(url), *_option_secrets(storage_options)])
