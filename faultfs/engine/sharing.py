"""The registry shared by every node of a shared store: fault contexts, tag states and
pagemaps (DESIGN §13).

Objects (beside the blob objects of ``faultfs.tiers.shared``):

    registry/<fault key>        the context's canonical bytes (secrets blanked, as locally)
    tags/<tag>/claim            the fault key that owns the tag name (written once)
    tags/<tag>/state.json       the tag state (source version, view name, …)
    tags/<tag>/pagemap          the tag's pagemap, when it has one

Invariants:
- Every object is read bounded by what its kind can be (``MAX_CONTEXT_BYTES``,
  ``MAX_CLAIM``, ``MAX_STATE``, ``MAX_PAGEMAP_TEXT``): a longer one is skipped by its length,
  not read whole (a 300 MiB tag state made a mount take 33 s).
- A tag name belongs to the first context that claimed it (a conditional put where the
  store supports it); registering another context under that name is refused with one line
  naming the owner; the same context again is a no-op.
- ``fetch`` trusts nothing: an entry that does not decode, does not hash to its own key, or
  does not own its name is skipped with a log line; a state or pagemap that does not parse is
  left out (the tag is still served: its version then comes from the source).
- Importing writes only into the local registry, tag states and pagemaps, and only for tags
  this store does not have; a tag of the same name with another context here is a conflict.
- Clones stay on their node (their data is dirty, and dirty data is never published).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from urllib.parse import quote

from faultfs.core.context import MAX_CONTEXT_BYTES, FaultContext, is_fault_key
from faultfs.core.pagemap import MAX_PAGEMAP_TEXT, parse
from faultfs.errors import CorruptionError, FaultfsError, InvalidInput
from faultfs.sources.secrets import display_url
from faultfs.store.blobfile import FLAG_DIRTY
from faultfs.store.blobstore import BlobStore
from faultfs.store.registry import Registry
from faultfs.store.tagstate import TagState, read_tag_state, write_tag_state
from faultfs.tiers.objects import Objects

log = logging.getLogger("faultfs.shared")

REGISTRY_PREFIX = "registry/"
MAX_STATE = 64 << 10
MAX_CLAIM = 256  # a claim is a fault key
PAGEMAP_BLOB = "pagemap"


def _tag_key(tag: str, what: str) -> str:
    return f"tags/{quote(tag, safe='')}/{what}"


def claim_key(tag: str) -> str:
    return _tag_key(tag, "claim")


def state_key(tag: str) -> str:
    return _tag_key(tag, "state.json")


def pagemap_key(tag: str) -> str:
    return _tag_key(tag, "pagemap")


def is_clone(ctx: FaultContext) -> bool:
    return ctx.cloned_from is not None


@dataclass
class SharedEntry:
    """One tag as the shared store has it."""

    ctx: FaultContext
    data: bytes  # canonical context bytes
    state: TagState | None = None
    pagemap: bytes | None = None


class SharedRegistry:
    """The shared registry of one shared store (blocking: object store I/O)."""

    def __init__(self, objects: Objects) -> None:
        self.objects = objects
        self.entries: dict[str, SharedEntry] = {}  # by tag name, as of the last fetch
        self._seen: dict[str, SharedEntry | None] = {}  # by fault key: decoded (None: unusable)

    @property
    def url(self) -> str:
        return self.objects.url

    def fetch(self) -> dict[str, SharedEntry]:
        """Every usable entry of the shared store, by tag name (OSError when unreachable).
        Entries seen before are not read again (an entry never changes under its key)."""
        found: dict[str, SharedEntry] = {}
        claims: dict[str, bytes | None] = {}
        for name in self.objects.list(REGISTRY_PREFIX):
            key = name[len(REGISTRY_PREFIX):]
            if not is_fault_key(key):
                continue
            if key in self._seen:
                seen = self._seen[key]
                if seen is not None and seen.ctx.dst not in found:
                    found[seen.ctx.dst] = seen
                continue
            try:
                raw = self._get(name, MAX_CONTEXT_BYTES)
            except CorruptionError as exc:
                log.warning("shared store %s: entry %s is not usable (%s): skipped", self.url,
                            key, exc)
                continue  # (read again at the next fetch: a keyed node may publish it over)
            if raw is None:
                continue
            try:
                ctx = FaultContext.decode(raw)
            except InvalidInput as exc:
                log.warning("shared store %s: entry %s is not a context (%s): skipped",
                            self.url, key, exc)
                self._seen[key] = None  # never usable: not read again
                continue
            if ctx.key != key:
                log.warning("shared store %s: entry %s holds a context with key %s: skipped",
                            self.url, key, ctx.key)
                self._seen[key] = None
                continue
            tag = ctx.dst
            if tag not in claims:
                claims[tag] = self._claim(tag)
            owner = claims[tag]
            if owner is not None and owner.decode("ascii", "replace").strip() != key:
                self._seen[key] = None  # a context that lost the race for this name: never served
                continue
            if tag in found:
                log.warning("shared store %s: tag %s has two unclaimed contexts; using %s",
                            self.url, tag, found[tag].ctx.key)
                continue
            found[tag] = self._seen[key] = SharedEntry(ctx, raw, self._state(tag, key),
                                                       self._pagemap(tag))
        self.entries = found
        return found

    def _get(self, key: str, limit: int) -> bytes | None:
        """Object ``key``, or None when absent; CorruptionError when it is longer than
        ``limit`` (not read further) or, in a sealed store, does not verify."""
        raw = self.objects.get(key, limit=limit)
        if raw is not None and len(raw) > limit:
            raise CorruptionError(f"{key} is larger than {limit} bytes")
        return raw

    def _claim(self, tag: str) -> bytes | None:
        """Who claimed ``tag`` (None: nobody, or a claim that is not usable)."""
        try:
            return self._get(claim_key(tag), MAX_CLAIM)
        except CorruptionError as exc:
            log.warning("shared store %s: the claim of tag %s is not usable (%s): ignored",
                        self.url, tag, exc)
            return None

    def _state(self, tag: str, key: str) -> TagState | None:
        try:
            raw = self._get(state_key(tag), MAX_STATE)
        except CorruptionError as exc:
            log.warning("shared store %s: the state of tag %s is not usable (%s): ignored",
                        self.url, tag, exc)
            return None
        if raw is None:
            return None
        try:
            doc = json.loads(raw)
        except ValueError:
            log.warning("shared store %s: the state of tag %s is not JSON: ignored", self.url, tag)
            return None
        if not isinstance(doc, dict):
            return None
        state = TagState.from_doc(doc)
        return state if state.key == key else None

    def _pagemap(self, tag: str) -> bytes | None:
        try:
            raw = self._get(pagemap_key(tag), MAX_PAGEMAP_TEXT)
            if raw is None:
                return None
            parse(raw.decode("utf-8"))
        except (UnicodeDecodeError, InvalidInput, CorruptionError) as exc:
            log.warning("shared store %s: the pagemap of tag %s does not parse (%s): ignored",
                        self.url, tag, exc)
            return None
        return raw

    # -- conflicts ---------------------------------------------------------------------------

    def conflict(self, ctx: FaultContext) -> str | None:
        """Why registering ``ctx`` would collide with another node's tag, or None."""
        entry = self.entries.get(ctx.dst)
        if entry is None or entry.ctx.key == ctx.key:
            return None
        return (f"tag {ctx.dst!r} is registered in the shared store {self.url} by another "
                f"context: source {display_url(entry.ctx.src)} ({entry.ctx.key}); pick "
                "another --tag")

    def check(self, ctx: FaultContext) -> None:
        problem = self.conflict(ctx)
        if problem:
            raise InvalidInput(problem)

    # -- into the local store ----------------------------------------------------------------

    def import_into(self, store: BlobStore, registered: set[str],
                    only: set[str] | None = None) -> list[str]:
        """Write the fetched tags this store does not have (of ``only``, when given) into
        its registry (blocking); the names imported. InvalidInput for a tag of the same name
        with another context."""
        imported = []
        registry = Registry(store)
        for tag, entry in sorted(self.entries.items()):
            if tag in registered or (only is not None and tag not in only):
                continue
            local = read_tag_state(store, tag)
            if local is not None and local.key != entry.ctx.key:
                raise InvalidInput(
                    f"tag {tag!r} is registered in store {store.root} with another context "
                    f"({local.key}) than in the shared store {self.url} ({entry.ctx.key}): "
                    "mount with another --store")
            registry.put(entry.ctx)
            if entry.state is not None and local is None:
                write_tag_state(store, tag, entry.state)
            if entry.pagemap is not None and store.read(tag, PAGEMAP_BLOB, max_len=MAX_PAGEMAP_TEXT) is None:
                store.put(tag, PAGEMAP_BLOB, entry.pagemap, flags=FLAG_DIRTY, durable=True)
            imported.append(tag)
        return imported

    # -- out of it ---------------------------------------------------------------------------

    def publish(self, ctx: FaultContext, state: TagState | None) -> bool:
        """Claim the tag's name, publish its context and state (blocking); False for a clone
        (never published). InvalidInput when another context owns the name."""
        if is_clone(ctx):
            return False
        tag = ctx.dst
        if not self.objects.put(claim_key(tag), ctx.key.encode("ascii"), create=True):
            claim = self._claim(tag)
            if claim is None:  # one that is not usable (not sealed with this store's key)
                self.objects.put(claim_key(tag), ctx.key.encode("ascii"))
            owner = (claim or b"").decode("ascii", "replace").strip()
            if owner and owner != ctx.key:
                raise InvalidInput(f"tag {tag!r} is registered in the shared store {self.url} "
                                   f"by another context ({owner}); pick another --tag")
        entry = f"{REGISTRY_PREFIX}{ctx.key}"
        if not self.objects.put(entry, ctx.encode(), create=True):
            try:
                usable = self._get(entry, MAX_CONTEXT_BYTES) == ctx.encode()
            except CorruptionError:
                usable = False
            if not usable:  # a context's bytes are fixed by its key: ours replace it
                self.objects.put(entry, ctx.encode())
        if state is not None:
            self.publish_state(tag, state)
        return True

    def publish_state(self, tag: str, state: TagState) -> None:
        entry = self.entries.get(tag)
        if entry is not None and entry.state == state:
            return  # unchanged: no write
        self.objects.put(state_key(tag), json.dumps(state.to_doc(), sort_keys=True).encode())

    def publish_pagemap(self, tag: str, data: bytes) -> None:
        self.objects.put(pagemap_key(tag), data)


def publish_tags(shared: SharedRegistry, store: BlobStore, contexts: list[FaultContext]) -> None:
    """Publish the registration of each tag (blocking; at mount). One line of InvalidInput
    when the shared store cannot be written or another context owns a name."""
    for ctx in contexts:
        try:
            shared.publish(ctx, read_tag_state(store, ctx.dst))
        except OSError as exc:
            raise FaultfsError(f"shared store {shared.url}: publishing tag {ctx.dst} failed: "
                               f"{exc.strerror or exc}") from None
