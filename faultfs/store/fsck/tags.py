"""The tags' directories as the walk checks them: each tag state (``tag.json``), each staged
clean blob (verified; stale when staged from another source version than the tag state's),
and the dirty blob ``pagemap`` (verified, and it must parse).

Invariants:
- A blob file's header must name the tag of its directory and the blob its file name says;
  blobs of a tag the registry does not know, or registered for another context, are
  *orphaned* (kept while a registered clone names the tag as its parent: they are that
  clone's clean chunks, ``KEEP_CLONED``). A tag of the faultfs:: protocol
  (``core.names.is_protocol_tag``) needs no registry entry: its name pins its object.
- Dirty data (the pagemap, a dirty blob) is never dropped (``KEEP_DIRTY``), unless it is not
  a file at all (a FIFO where the pagemap should be holds no data).
- An orphaned tag's directory is pruned once emptied (``prune``: only after something was
  dropped).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from faultfs.core.context import is_fault_key
from faultfs.core.names import is_protocol_tag
from faultfs.core.pagemap import MAX_PAGEMAP_TEXT, parse
from faultfs.store.entries import TAG_STATE, encode_component
from faultfs.store.fsck.blobs import BlobReader, blob_name
from faultfs.store.fsck.findings import (
    BLOBS,
    DAMAGED,
    DIRTY,
    KEEP_CLONED,
    KEEP_DIRTY,
    OK,
    ORPHANED,
    PAGEMAPS,
    STALE,
    TAG_STATES,
    Finding,
)
from faultfs.store.fsck.look import (
    is_temp,
    kind,
    lsize,
    read_json,
    scan,
    temp_finding,
    unknown_finding,
)
from faultfs.store.fsck.registry import KnownTags

PAGEMAP_BLOB = "pagemap"  # DESIGN §2: a tag's pagemap is its blob "pagemap" (user data)


class TagDirs:
    """The findings of ``tags/``: every tag's directory but the registry's (``KnownTags``)."""

    def __init__(self, known: KnownTags, blobs: BlobReader,
                 prune: Callable[[str], None]) -> None:
        self._known = known
        self._blobs = blobs
        self._prune = prune  # an orphaned tag's directory, once its findings were handled

    def findings(self) -> Iterator[Finding]:
        for entry in scan(self._known.tags_dir):
            if entry.name == self._known.dirname:
                continue
            tag = self._known.tag_of(entry.name)
            is_store_name = entry.name.startswith(("t-", "h-"))
            if not entry.is_dir(follow_symlinks=False):
                if is_store_name:  # a file, link or FIFO where a tag's directory should be
                    mode, size = lsize(entry.path)
                    yield Finding(TAG_STATES, DAMAGED, entry.path, size,
                                  f"{kind(mode)} stands where the directory of tag "
                                  f"{tag or entry.name} should be")
                else:
                    yield unknown_finding(entry.path)
                continue
            if not is_store_name or (tag is None and entry.name.startswith("t-")):
                yield unknown_finding(entry.path)
                continue
            yield from self._tag_dir(entry.path, entry.name, tag)

    def _tag_dir(self, directory: str, dirname: str, tag: str | None) -> Iterator[Finding]:
        label = tag if tag is not None else dirname
        keys = self._known.by_tag.get(tag, []) if tag is not None else []
        state_path = os.path.join(directory, TAG_STATE)
        state_doc: dict | None = None
        state_problem = ""
        if os.path.lexists(state_path):
            state_doc, state_problem = read_json(state_path)
            if state_doc is not None and not is_fault_key(str(state_doc.get("key"))):
                state_problem = "names no fault key"
        orphan = ""
        if not keys and not (tag is not None and is_protocol_tag(tag)):
            # a faultfs:: tag needs no entry: its name pins its object and version
            orphan = f"tag {label} has no registry entry"
        elif state_doc is not None and not state_problem and state_doc["key"] not in keys:
            orphan = (f"tag {label} was staged for context {state_doc['key']}, but it is "
                      f"registered as {keys[0]}")
        kept = ""
        if orphan and state_doc is not None and not state_problem and (
                state_doc["key"] in self._known.parents):
            kept = KEEP_CLONED
        version: str | None = None
        if state_doc is not None and not state_problem and not orphan:
            found = state_doc.get("source_version")
            version = found if isinstance(found, str) else None
        if os.path.lexists(state_path):
            _, size = lsize(state_path)
            subject = f"tag state of {label}"
            if state_problem:
                yield Finding(TAG_STATES, DAMAGED, state_path, size, f"{subject}: {state_problem}")
            elif orphan:
                yield Finding(TAG_STATES, ORPHANED, state_path, size, f"{subject}: {orphan}",
                              kept)
            else:
                yield Finding(TAG_STATES, OK, state_path, size)

        def owns(header_tag: str) -> bool:
            return header_tag == tag if tag is not None else (
                encode_component("t-", header_tag) == dirname)

        for entry in scan(directory):
            if entry.name == TAG_STATE:
                continue
            if is_temp(entry.name):
                yield temp_finding(entry.path)
            elif entry.name.startswith(("b-", "h-")):
                yield self._staged(entry, label, owns, version, orphan, kept)
            else:
                yield unknown_finding(entry.path)
        if orphan:
            self._prune(directory)

    def _staged(self, entry: os.DirEntry, label: str, owns: Callable[[str], bool],
                version: str | None, orphan: str, kept: str = "") -> Finding:
        """One blob file of a tag's directory: clean (staged), or the dirty pagemap."""
        path = entry.path
        name, hashed = blob_name(entry.name)
        if name is None and not hashed:
            return unknown_finding(path)
        _, size = lsize(path)
        pagemap = name == PAGEMAP_BLOB
        blob = self._blobs.read(path, owners=owns, name=name,
                                keep_payload=MAX_PAGEMAP_TEXT if pagemap else 0)
        header = blob.header
        if hashed and header is not None and not blob.problem:
            name = header.name
            if encode_component("b-", name) != entry.name:
                blob.problem = f"holds blob {name!r}, which is not named so"
        subject = f"blob {name or entry.name} of tag {label}"
        dirty = pagemap or (header is not None and header.dirty)
        area = PAGEMAPS if pagemap else DIRTY if dirty else BLOBS
        if blob.problem:  # a damaged pagemap is kept: it is user data (a FIFO holds none)
            keep = KEEP_DIRTY if dirty and not blob.foreign else ""
            return Finding(area, DAMAGED, path, size, f"{subject}: {blob.problem}", keep)
        assert header is not None
        if dirty:
            if pagemap and self._blobs.verify:
                problem = (_pagemap_problem(blob.payload) if blob.payload is not None
                           else f"{header.payload_len} bytes, over {MAX_PAGEMAP_TEXT}")
                if problem:
                    return Finding(area, DAMAGED, path, size, f"pagemap of tag {label}: {problem}",
                                   KEEP_DIRTY)
            if orphan:
                return Finding(area, ORPHANED, path, size, f"{subject}: {orphan}", KEEP_DIRTY)
            return Finding(area, OK, path, size)
        if orphan:
            return Finding(area, ORPHANED, path, size, f"{subject}: {orphan}", kept)
        if version is not None and header.source_version != version:
            return Finding(area, STALE, path, size,
                           f"{subject}: staged from source version {header.source_version!r}, "
                           f"the tag's is {version!r}")
        return Finding(area, OK, path, size)


def _pagemap_problem(payload: bytes) -> str:
    """Why a stored pagemap shows no pages (``parse`` gives the empty map), or ""."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text: no pages are shown"
    if parse(text).empty:
        return "does not parse as a pagemap: no pages are shown"
    return ""
