"""Tag state: what the store remembers of a tag between mounts (``tags/t-<tag>/tag.json``).

Fields: the fault key of its context, the source version its clean blobs were staged from,
its shard index, the name of its whole-object view, the source's mtime, and how a remote
source was reached (``remote``: endpoint and ``--anon``, never credentials).

Invariants:
- The JSON is written atomically (temp + fsync + rename) with sorted keys, as before this
  module existed: a store of an older faultfs reads the same.
- A field of the wrong type reads as absent; a file that is not a JSON object is a
  ``CorruptionError``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from faultfs.errors import CorruptionError
from faultfs.store.blobstore import BlobStore

log = logging.getLogger("faultfs.store")


@dataclass(frozen=True)
class TagState:
    key: str
    source_version: str | None = None  # SourceVersion.to_text() of the staged blobs
    shard: int = 0
    view_name: str | None = None
    mtime: float = 0.0
    remote: dict[str, Any] = field(default_factory=dict)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"key": self.key, "source_version": self.source_version,
                               "shard": self.shard, "view_name": self.view_name,
                               "mtime": self.mtime}
        if self.remote:
            doc["remote"] = self.remote
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> TagState:
        def typed(name: str, kind: type | tuple[type, ...], default: Any) -> Any:
            value = doc.get(name, default)
            return value if isinstance(value, kind) and not isinstance(value, bool) else default

        return cls(key=typed("key", str, ""),
                   source_version=typed("source_version", str, None),
                   shard=typed("shard", int, 0),
                   view_name=typed("view_name", str, None),
                   mtime=float(typed("mtime", (int, float), 0.0)),
                   remote=typed("remote", dict, {}))


def read_tag_state(store: BlobStore, tag: str) -> TagState | None:
    """The tag's state; None when there is none, or when it is damaged (logged: the tag is
    then recovered without trusting its staged blobs, whose headers are all checked)."""
    try:
        doc = store.read_tag_state(tag)
    except CorruptionError as exc:
        log.warning("tag %s: %s: its staged blobs are checked one by one", tag, exc)
        return None
    return None if doc is None else TagState.from_doc(doc)


def write_tag_state(store: BlobStore, tag: str, state: TagState) -> None:
    store.write_tag_state(tag, state.to_doc())
