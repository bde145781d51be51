"""The registry as the walk sees it: every entry of the registry tag verified and decoded,
and what the later passes need of it — which tags are registered, under which fault keys,
and which directory names are theirs.

Invariants:
- An entry is ok when its blob file verifies and holds the canonical context whose fault key
  is its name; a tag is registered by one entry (the one its tag state names).
- Memory is bounded by the number of tags: findings are held until the pass ends (a tag
  registered twice is only known then), one per entry of the registry.
- A tag registered by several entries keeps only the one its tag state names; a registry
  entry without a tag state is kept (``KEEP_RECOVERABLE``): a mount recovers it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from urllib.parse import unquote

from faultfs.core.context import REGISTRY_TAG, FaultContext, is_fault_key
from faultfs.errors import InvalidInput
from faultfs.store.entries import TAG_STATE, encode_component, real_dir
from faultfs.store.fsck.blobs import BlobReader, blob_name
from faultfs.store.fsck.findings import DAMAGED, KEEP_RECOVERABLE, OK, ORPHANED, REGISTRY, Finding
from faultfs.store.fsck.look import (
    is_temp,
    kind,
    lsize,
    read_json,
    scan,
    temp_finding,
    unknown_finding,
)

MAX_CONTEXT_BYTES = 1 << 20  # as core.context: a registry entry larger is not ours


class KnownTags:
    """The registered tags, as read by ``findings()`` (the registry pass): bounded by the
    number of tags."""

    def __init__(self, tags_dir: str, blobs: BlobReader) -> None:
        self.tags_dir = tags_dir
        self.dirname = encode_component("t-", REGISTRY_TAG)  # the registry's own directory
        self.by_tag: dict[str, list[str]] = {}  # tag -> keys registering it
        self.dirs: dict[str, str] = {}  # encoded directory name -> tag
        self.parents: set[str] = set()  # keys registered clones were cloned from
        self._blobs = blobs

    def findings(self) -> Iterator[Finding]:
        """Every registry entry, read whole (they are small): which tags are registered, under
        which keys. Findings are held until the pass ends: a tag registered twice is only
        known then (one finding per tag: bounded by the number of tags)."""
        directory = os.path.join(self.tags_dir, self.dirname)
        held: list[tuple[Finding, str, FaultContext]] = []  # (finding, key, ctx): usable ones
        out: list[Finding] = []
        if os.path.lexists(directory) and not real_dir(directory):
            mode, size = lsize(directory)  # the store sees no registry either (and replaces it)
            out.append(Finding(REGISTRY, DAMAGED, directory, size,
                               f"{kind(mode)} stands where the registry's directory should be"))
        for entry in scan(directory):
            path = entry.path
            if is_temp(entry.name):
                out.append(temp_finding(path))
                continue
            if not entry.name.startswith(("b-", "h-")):
                out.append(unknown_finding(path))
                continue
            name, hashed = blob_name(entry.name)
            if name is None and not hashed:
                out.append(unknown_finding(path))
                continue
            _, size = lsize(path)
            blob = self._blobs.read(path, owners=lambda t: t == REGISTRY_TAG, name=name,
                                    keep_payload=MAX_CONTEXT_BYTES, verify=True)
            if hashed and blob.header is not None and not blob.problem and (
                    encode_component("b-", blob.header.name) != entry.name):
                blob.problem = f"holds blob {blob.header.name!r}, which is not named so"
            key = name or (blob.header.name if blob.header is not None else entry.name)
            subject = f"registry entry {key}"
            if blob.problem:
                out.append(Finding(REGISTRY, DAMAGED, path, size, f"{subject}: {blob.problem}"))
                continue
            if not is_fault_key(key):
                out.append(Finding(REGISTRY, ORPHANED, path, size,
                                   f"{subject}: not a fault key (a mount never reads it)"))
                continue
            assert blob.payload is not None
            try:
                ctx = FaultContext.decode(blob.payload)
            except InvalidInput as exc:
                out.append(Finding(REGISTRY, DAMAGED, path, size,
                                   f"{subject}: not a fault context ({exc.message})"))
                continue
            if ctx.key != key:
                out.append(Finding(REGISTRY, DAMAGED, path, size,
                                   f"{subject}: holds the context of {ctx.key}"))
                continue
            held.append((Finding(REGISTRY, OK, path, size), key, ctx))
            self.by_tag.setdefault(ctx.dst, []).append(key)
        for finding, key, ctx in held:
            tag = ctx.dst
            keys = self.by_tag[tag]
            state_key = self.state_key(tag)
            if len(keys) > 1 and state_key in keys and key != state_key:
                finding.status = ORPHANED
                finding.reason = (f"registry entry {key}: tag {tag} is registered again by "
                                  f"{state_key}, the context its tag state names")
            elif state_key is None:
                finding.status = ORPHANED
                finding.keep = KEEP_RECOVERABLE
                finding.reason = f"registry entry {key}: tag {tag} has no tag state"
            if ctx.cloned_from is not None and (finding.status == OK or finding.keep):
                self.parents.add(ctx.cloned_from)
            out.append(finding)
        for tag, keys in self.by_tag.items():
            state_key = self.state_key(tag)
            if len(keys) > 1 and state_key in keys:
                keys[:] = [state_key]
            self.dirs[encode_component("t-", tag)] = tag
        yield from out

    def state_key(self, tag: str) -> str | None:
        """The key a tag's state names: "" when the state is there but unusable, None when
        there is none."""
        path = os.path.join(self.tags_dir, encode_component("t-", tag), TAG_STATE)
        if not os.path.lexists(path):
            return None
        doc, _ = read_json(path)
        key = doc.get("key") if doc is not None else None
        return key if isinstance(key, str) else ""

    def tag_of(self, dirname: str) -> str | None:
        """The tag a directory of ``tags/`` or ``writes/`` is for; None when unknown (a hashed
        name no registered tag has, or a name the store would never make)."""
        tag = self.dirs.get(dirname)
        if tag is not None or not dirname.startswith("t-"):
            return tag
        tag = unquote(dirname[2:])
        return tag if encode_component("t-", tag) == dirname else None
