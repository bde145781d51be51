"""Tags: registering sources on-fault (check, then persist) and recovering registered ones.

Invariants:
- ``plan`` checks everything a registration needs — name, assimilator (-20 when it cannot
  ingest per blob), source (exists, is a file), range, chunk size — and persists nothing;
  ``commit`` persists the context (secrets blanked) and the tag state, then adds the tag.
- A tag re-registered with a different context loses its old blobs and registry entry;
  refused while clones of it are registered (they read those blobs).
- ``recover`` brings back every tag whose context is in the registry; a tag whose source is
  unreachable still serves what is staged (``source_error`` says why the rest fails).
- A clone's clean chunks are its ancestor's: the tag that owns the source (``Tag.clean``,
  resolved when the clone is registered or recovered, through the contexts' "clone of" keys)
  stages them, and the clone reads them there. A clone has no staged blobs of its own, unless
  that ancestor is not registered here at the clone's source version (then it stages its
  own, as a tag that owns its source).
- Registration and recovery block (they run before the mount answers).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import assimilators
from assimilators.base import Assimilator, BlobLayout
from faultfs.core.context import CLONE_OF, REGISTRY_TAG, FaultContext
from faultfs.core.names import check_name, check_tag_name
from faultfs.errors import RC_CANNOT_INGEST_PER_BLOB, FaultfsError, InvalidInput
from faultfs.sources import (
    S3_PROTOCOLS,
    Source,
    SourceOptions,
    SourceVersion,
    local_path,
    persistable_src,
    url_protocol,
)
from faultfs.stats import Stats
from faultfs.store.blobstore import BlobStore
from faultfs.store.registry import Registry, RegistryProblem
from faultfs.store.tagstate import TagState, read_tag_state, write_tag_state
from faultfs.tiers.base import TierTag
from faultfs.tiers.multilevel import TierStack

log = logging.getLogger("faultfs.engine")


@dataclass
class Tag:
    """One registered source: its context, layout, pinned version and how its reads go."""

    id: int
    name: str
    ctx: FaultContext
    layout: BlobLayout
    version: SourceVersion
    mtime: float
    view_name: str
    assimilator: Assimilator
    shard: int = 0
    source: Source | None = None
    source_error: str = ""
    stale_dropped: int = 0
    source_changed: bool = False  # the source differs from what the last mount recorded
    _changed_under_mount: str = field(default="", repr=False)  # see changed_under_mount
    remote: dict = field(default_factory=dict)  # how the source was reached (tag state)
    last_index: int = -1  # the blob read last: sequential readers get prefetch
    window: int = 0  # blobs to prefetch ahead of a sequential reader (grows, resets)
    state_stale: bool = False  # recovered with a state file that must be rewritten
    ancestor: Tag | None = None  # a clone's: the tag owning the source, whose blobs it reads

    @property
    def key(self) -> str:
        return self.ctx.key

    @property
    def clean(self) -> Tag:
        """The tag whose staged blobs are this tag's clean chunks: itself, or for a clone the
        ancestor that owns the source (same source, same version: the same bytes)."""
        return self.ancestor or self

    @property
    def changed_under_mount(self) -> str:
        """Why a fault found the source changed since the mount ("" until one did); a clone
        shares its ancestor's (its faults are the ancestor's)."""
        return self.clean._changed_under_mount

    @changed_under_mount.setter
    def changed_under_mount(self, why: str) -> None:
        self.clean._changed_under_mount = why

    @property
    def version_text(self) -> str:
        return self.version.to_text()

    def tier_view(self) -> TierTag:
        layout = self.layout
        return TierTag(self.id, self.name, self.version_text, layout.num_blobs,
                       layout.chunk_size, layout.blob_name, layout.blob_index, self.key)


@dataclass
class Recovery:
    """A registered context brought back, before its tag is added (``open_recovered``)."""

    ctx: FaultContext
    state: TagState
    assimilator: Assimilator
    recorded: SourceVersion | None  # the version the tag state names
    source: Source | None
    version: SourceVersion
    error: str  # why the source could not be opened ("" when it was)
    layout: BlobLayout
    mtime: float


@dataclass
class RegistrationPlan:
    """A checked registration, not yet persisted."""

    ctx: FaultContext
    source: Source
    version: SourceVersion
    layout: BlobLayout
    assimilator: Assimilator


class Tags:
    """The registered tags of one store, by name and by id."""

    def __init__(self, store: BlobStore, tiers: TierStack, stats: Stats,
                 source_options: SourceOptions) -> None:
        self.store = store
        self.registry_store = Registry(store)
        self.tiers = tiers
        self.stats = stats
        self.source_options = source_options
        self.by_name: dict[str, Tag] = {}
        self.by_id: dict[int, Tag] = {}
        self.registry: dict[str, bytes] = {}  # fault key -> canonical context bytes
        self._next_id = 1

    # -- registration ------------------------------------------------------------------------

    def plan(self, ctx: FaultContext) -> RegistrationPlan:
        """Check a registration without persisting anything."""
        check_tag_name(ctx.dst)
        if ctx.dst == REGISTRY_TAG:
            raise InvalidInput(f"tag name {ctx.dst!r} is reserved for the registry")
        assimilator = assimilators.get(ctx.format)
        if ctx.on_fault and assimilator.blob_bytes(ctx) == 0:
            raise FaultfsError(
                f"assimilator {ctx.format!r} cannot ingest per blob (result code "
                f"{RC_CANNOT_INGEST_PER_BLOB}): it cannot serve source {ctx.src} on fault",
                errno.ENOTSUP, code=RC_CANNOT_INGEST_PER_BLOB)
        source = assimilator.open(ctx, self.source_options)
        try:
            version = source.version()
            layout = assimilator.layout(ctx, version)
        except BaseException:
            source.close()
            raise
        ctx = persistable(ctx)  # the source is open with the real URL; credentials stop here
        old = self.by_name.get(ctx.dst)
        if old is not None and old.key != ctx.key:
            source.close()
            raise InvalidInput(f"tag {ctx.dst!r} is registered twice with different sources")
        return RegistrationPlan(ctx, source, version, layout, assimilator)

    def commit(self, plan: RegistrationPlan, *, shard: int = 0) -> Tag:
        """Persist a checked registration and add its tag."""
        ctx = plan.ctx
        if ctx.dst in self.by_name:
            plan.source.close()
            return self.by_name[ctx.dst]
        previous = read_tag_state(self.store, ctx.dst)
        degraded = self.store.degraded
        if previous is not None and previous.key != ctx.key:
            clones = self._clones_of(previous.key)
            if clones:
                plan.source.close()
                raise InvalidInput(f"tag {ctx.dst!r} is registered with another source, and its "
                                   f"clones ({', '.join(clones)}) read its staged blobs: forget "
                                   "them first")
            if degraded:
                raise InvalidInput(f"tag {ctx.dst!r} is registered with another source, and the "
                                   f"store cannot be written ({degraded}) to replace it")
            log.info("tag %s is re-registered with a new context: dropping its old blobs", ctx.dst)
            self.registry_store.delete(previous.key)
            self.registry.pop(previous.key, None)
            self.store.forget_tag(ctx.dst)
        if degraded:
            log.warning("tag %s: registered for this mount only: the store cannot be written "
                        "(%s)", ctx.dst, degraded)
            self.registry[ctx.key] = ctx.encode()
        else:
            self.registry[ctx.key] = self.registry_store.put(ctx)
        recorded = previous.source_version if previous is not None and previous.key == ctx.key else None
        tag = self._add(ctx, plan.layout, plan.version, plan.source, plan.assimilator,
                        shard=shard, recorded=recorded)
        tag.remote = remote_settings(ctx.src, self.source_options)
        self.write_state(tag)
        return tag

    def _clones_of(self, key: str) -> list[str]:
        """The registered clones made of the tag registered as ``key`` (blocking)."""
        return sorted(entry[1].dst for entry in self.registry_store.entries()
                      if not isinstance(entry, RegistryProblem) and entry[1].cloned_from == key)

    def write_state(self, tag: Tag) -> None:
        """(Blocking) The tag's state file, as the tag now is."""
        if self.store.degraded:
            return  # nothing can be written; the next writable mount records it
        write_tag_state(self.store, tag.name, TagState(
            key=tag.key, source_version=tag.version_text, shard=tag.shard,
            view_name=tag.view_name, mtime=tag.mtime, remote=tag.remote))

    def _add(self, ctx: FaultContext, layout: BlobLayout, version: SourceVersion,
             source: Source | None, assimilator: Assimilator, *, shard: int,
             mtime: float | None = None, view_name: str | None = None,
             recorded: str | None = None, ancestor: Tag | None = None) -> Tag:
        """``recorded``: the source version the tag's state file names, if any;
        ``ancestor``: a clone's ``Tag.clean`` (the tiers then hold nothing of its own)."""
        if view_name is None:
            view_name = view_name_for(ctx.src)
        if mtime is None:
            mtime = source.mtime() if source else time.time()
        tag = Tag(id=self._next_id, name=ctx.dst, ctx=ctx, layout=layout, version=version,
                  mtime=mtime, view_name=view_name, assimilator=assimilator, shard=shard,
                  source=source, ancestor=ancestor)
        self._next_id += 1
        if ancestor is None:
            scan = self.tiers.open_tag(tag.tier_view(), trusted=recorded == tag.version_text)
            tag.stale_dropped = scan.stale_dropped
            self.stats.add("stale_blobs_dropped", scan.stale_dropped)
            self.stats.add("corrupt_blobs_dropped", scan.corrupt_dropped)
        self.by_name[tag.name] = tag
        self.by_id[tag.id] = tag
        return tag

    def detach(self, tag: Tag) -> None:
        """Stop serving ``tag`` (``faultfs forget``; its files are removed by ``remove``)."""
        self.by_name.pop(tag.name, None)
        self.by_id.pop(tag.id, None)
        self.registry.pop(tag.key, None)
        if tag.source is not None and not self._shares_source(tag):
            tag.source.close()

    def _shares_source(self, tag: Tag) -> bool:
        """Whether another registered tag reads through ``tag``'s open source (a clone and
        its parent share one until a remount opens each its own): it stays open for them."""
        return any(other.source is tag.source for other in self.by_id.values()
                   if other is not tag)

    def remove(self, tag: Tag, *, keep_blobs: bool) -> int:
        """Delete a detached tag's registry entry, and its blobs and state unless
        ``keep_blobs`` (blocking); the bytes freed."""
        self.registry_store.delete(tag.key)
        if keep_blobs:
            return 0
        freed = sum(size for _, size in self.store.scan_blobs(tag.name))
        self.store.forget_tag(tag.name)
        return freed

    def clone_entry(self, parent: Tag, name: str) -> tuple[FaultContext, bytes]:
        """The blocking half of registering ``name`` as a copy of ``parent``: the store has
        no such tag; its registry entry written. Nothing is added yet (``add_clone``)."""
        check_tag_name(name)
        if name in self.by_name or name == REGISTRY_TAG:
            raise FaultfsError(f"tag {name!r} exists", errno.EEXIST)
        if read_tag_state(self.store, name) is not None:
            raise FaultfsError(f"the store has a tag {name!r} already (not mounted)",
                               errno.EEXIST)
        ctx = replace(parent.ctx, dst=name, src_data=f"{CLONE_OF}{parent.key}")
        return ctx, self.registry_store.put(ctx)

    def add_clone(self, parent: Tag, ctx: FaultContext, entry: bytes) -> Tag:
        """The clone of ``clone_entry`` in the tables (on the thread that reads them, as
        ``add_recovered``): the same source at the same version, reading the staged blobs of
        the ancestor that owns it (no second copy). Its state is the caller's to write
        (``write_state``, blocking), after it gave it the parent's writes."""
        self.registry[ctx.key] = entry
        tag = self._add(ctx, parent.layout, parent.version, parent.source, parent.assimilator,
                        shard=parent.shard, mtime=parent.mtime, view_name=parent.view_name,
                        ancestor=parent.clean)
        tag.remote = dict(parent.remote)
        return tag

    # -- recovery ----------------------------------------------------------------------------

    def recover(self) -> list[Tag]:
        """Bring back every tag whose context is in the registry (remount with no source).
        Their states are not written here: the caller does, through ``record_recovered``,
        once what depends on the version they recorded (the writes over it) is settled."""
        recovered = []
        entries = []
        for entry in self.registry_store.entries():
            if isinstance(entry, RegistryProblem):
                log.warning("registry entry %s is %s: skipped", entry.key, entry.reason)
            else:
                entries.append(entry)
        # an ancestor before its clones, which read its staged blobs (``Tag.clean``)
        contexts = {key: ctx for key, ctx, _ in entries}
        entries.sort(key=lambda entry: clone_depth(entry[1], contexts))
        for key, ctx, data in entries:
            if ctx.dst in self.by_name:
                continue
            try:
                tag = self.add_recovered(self.open_recovered(ctx))
            except FaultfsError as exc:  # one tag that cannot come back never blocks the rest
                log.error("tag %s cannot be recovered (not mounted): %s", ctx.dst, exc.message)
                continue
            self.registry[key] = data
            recovered.append(tag)
        return recovered

    def open_recovered(self, ctx: FaultContext) -> Recovery:
        """The blocking half of recovering ``ctx``: its state, its source opened (or why
        not), its version and layout. Nothing is added yet."""
        state = read_tag_state(self.store, ctx.dst) or TagState(key=ctx.key)
        if state.key != ctx.key:  # the state of another context: none of it is trusted
            log.warning("tag %s: its state names another context (%s, not %s): ignored",
                        ctx.dst, state.key or "none", ctx.key)
            state = TagState(key=ctx.key)
        assimilator = assimilators.get(ctx.format)
        recorded = SourceVersion.from_text(state.source_version) if state.source_version else None
        source: Source | None = None
        error = ""
        options = recovery_options(self.source_options, state.remote)
        try:
            source = assimilator.open(ctx, options)
            version = source.version()
        except FaultfsError as exc:
            if recorded is None:
                raise
            error = exc.message
            version = recorded
            log.warning("tag %s: source unavailable (%s); staged blobs still serve", ctx.dst, error)
        layout = assimilator.layout(ctx, version)
        mtime = state.mtime if source is None else source.mtime()
        return Recovery(ctx, state, assimilator, recorded, source, version, error, layout, mtime)

    def add_recovered(self, rec: Recovery) -> Tag:
        """The quick half: add the tag (its blobs in the store are scanned)."""
        ctx, state, recorded, version = rec.ctx, rec.state, rec.recorded, rec.version
        tag = self._add(ctx, rec.layout, version, rec.source, rec.assimilator, shard=state.shard,
                        mtime=rec.mtime, view_name=state.view_name,
                        recorded=recorded.to_text() if recorded is not None else None,
                        ancestor=self._ancestor(ctx, version))
        tag.source_error = rec.error
        tag.remote = remote_settings(ctx.src, recovery_options(SourceOptions(), state.remote))
        if recorded is not None and recorded != version:
            tag.source_changed = True
            log.warning("tag %s: source %s changed (%s -> %s); %d stale blobs dropped, "
                        "re-faulting from the new version", ctx.dst, ctx.src, recorded.describe(),
                        version.describe(), tag.stale_dropped)
        tag.state_stale = recorded != version or state.view_name is None
        return tag

    def _ancestor(self, ctx: FaultContext, version: SourceVersion) -> Tag | None:
        """A recovered clone's ``Tag.clean``: its parent's, when the parent is registered
        here at the same source version; None (it stages its own, logged) otherwise, and for
        a tag that is no clone."""
        parent_key = ctx.cloned_from
        if parent_key is None:
            return None
        parent = next((t for t in self.by_id.values() if t.key == parent_key), None)
        if parent is None:
            log.warning("tag %s: the tag it was cloned from (%s) is not registered: its clean "
                        "chunks are faulted from the source and staged as its own", ctx.dst,
                        parent_key)
            return None
        if parent.clean.version_text != version.to_text():
            log.warning("tag %s: the tag it was cloned from (%s) is at source version %s, not "
                        "its %s: its clean chunks are staged as its own", ctx.dst, parent.name,
                        parent.clean.version.describe(), version.describe())
            return None
        return parent.clean

    def record_recovered(self, tag: Tag) -> None:
        """Write the state of a recovered tag when it changed (blocking)."""
        if tag.state_stale:
            self.write_state(tag)
            tag.state_stale = False

    def close(self) -> None:
        for source in {id(t.source): t.source for t in self.by_name.values()}.values():
            if source is not None:
                source.close()  # once each, also when clones share it


def clone_depth(ctx: FaultContext, contexts: dict[str, FaultContext]) -> int:
    """How many registered contexts lie between ``ctx`` and the one owning its source: 0 for
    a tag that is no clone (or whose parent ``contexts`` lacks), 1 for a clone of it, ..."""
    depth, seen, parent = 0, set(), ctx.cloned_from
    while parent is not None and parent in contexts and parent not in seen:
        seen.add(parent)
        depth += 1
        parent = contexts[parent].cloned_from
    return depth


def remote_settings(src: str, options: SourceOptions) -> dict:
    """What a remount needs to reach a remote source again, recorded in the tag state when
    the tag is registered (a remount never changes it; registering the source again does):
    the S3 endpoint given with ``--s3-endpoint-url`` (S3 sources only) and ``--anon``. Empty
    for a local source. An endpoint carrying credentials (userinfo, a query) is not kept."""
    if local_path(src) is not None:
        return {}
    out: dict = {}
    endpoint = options.s3_endpoint_url
    if endpoint and url_protocol(src) in S3_PROTOCOLS:
        parts = urlsplit(endpoint)
        if parts.username or parts.password or parts.query or parts.fragment:
            log.warning("the S3 endpoint carries credentials: not kept for remounts")
        else:
            out["s3_endpoint_url"] = endpoint
    if options.anon:
        out["anon"] = True
    return out


def recovery_options(options: SourceOptions, recorded: dict) -> SourceOptions:
    """The options a recovered tag opens its source with: the mount's flags first, then what
    the tag was registered with (then, inside the S3 client, the environment)."""
    endpoint = options.s3_endpoint_url or str(recorded.get("s3_endpoint_url") or "")
    return replace(options, s3_endpoint_url=endpoint,
                   anon=options.anon or recorded.get("anon") is True)


def persistable(ctx: FaultContext) -> FaultContext:
    """``ctx`` as it may be hashed and persisted: a remote source URL with the credentials it
    carries (a presigned query, ``user:password@``) replaced by ``***`` (DESIGN §3)."""
    src = persistable_src(ctx.src)
    return ctx if src == ctx.src else replace(ctx, src=src)


def view_name_for(src: str) -> str:
    """The whole-object view's name: the source's basename."""
    path = local_path(src)
    base = os.path.basename((path if path is not None else src.split("?")[0]).rstrip("/"))
    try:
        return check_name(base, "source basename")
    except InvalidInput:
        return "data"


def default_tag_name(src: str) -> str:
    """A tag name from the source: its basename without the last extension."""
    base = view_name_for(src)
    stem = base.rsplit(".", 1)[0] if "." in base.lstrip(".") else base
    stem = stem.lstrip(".") or "data"
    return stem.replace("..", "_")
