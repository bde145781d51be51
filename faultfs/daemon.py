"""The composition root: a mount request and its configuration -> store -> sources -> tiers
-> engine -> served tree.

Invariants:
- Nothing is persisted until every source of the request has been checked; a refused mount
  leaves the store's registrations as they were.
- The store is locked for as long as the engine lives; it is released however ``run`` ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from faultfs.config import Config
from faultfs.core.context import MAX_CHUNK_SIZE, FaultContext
from faultfs.core.names import check_tag_name
from faultfs.core.pagemap import MAX_PAGE_SIZE
from faultfs.engine import Engine, default_tag_name
from faultfs.errors import InvalidInput
from faultfs.fuse.mountpoint import prepare_mountpoint
from faultfs.sources import SourceOptions, expand_sources
from faultfs.store.blobstore import BlobStore

log = logging.getLogger("faultfs")


@dataclass(frozen=True)
class MountSpec:
    """What to mount where: the sources (none: remount what the store has) and how to cut them."""

    sources: tuple[str, ...]
    mountpoint: str
    tag: str | None = None
    chunk_size: int = 0
    blob_prefix: str = "chunk_"
    range_off: int = 0
    range_size: int = 0
    format: str = "binary"
    page_size: int = 0
    allow_other: bool = False

    def check(self) -> None:
        if self.tag is not None:
            check_tag_name(self.tag)
        if not 0 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidInput(f"chunk size {self.chunk_size} is not in [0, 1 GiB]")
        if self.page_size > MAX_PAGE_SIZE:
            raise InvalidInput(f"page size {self.page_size} is over the 1 GiB limit")


def prepare(spec: MountSpec, config: Config, options: SourceOptions) -> tuple[Engine, str]:
    """Everything a mount needs before it answers: store, lock, tags. Returns the engine (its
    store locked) and the absolute mountpoint."""
    spec.check()
    store = BlobStore(config.store_dir)
    store.acquire()
    try:
        mountpoint = prepare_mountpoint(spec.mountpoint)
        engine = Engine(store, config, options)
        urls = expand_sources(list(spec.sources), options) if spec.sources else []
        if spec.tag is not None and len(urls) > 1:
            raise InvalidInput(f"--tag names one tag, but {len(urls)} sources were given")
        contexts = []
        used: set[str] = set()
        for url in urls:
            name = spec.tag or _unique(default_tag_name(url), used)
            used.add(name)
            contexts.append(FaultContext(
                src=url, dst=name, format=spec.format, s3_region=options.s3_region,
                s3_profile=options.s3_profile, blob_prefix=spec.blob_prefix,
                range_off=spec.range_off, range_size=spec.range_size,
                chunk_size=spec.chunk_size, on_fault=True))
        plans = [engine.plan(ctx) for ctx in contexts]  # validates every source first
        # A URL with credentials in it (userinfo, a presigned query) was opened as given; the
        # context that is persisted and hashed names it with those values as *** (the registry
        # never holds a secret). The real URL lives only in the opened source, in memory: a
        # remount without the source cannot re-open it (docs/sources.md, "Secrets").
        for shard, plan in enumerate(plans):
            engine.commit_plan(plan, shard=shard)
        engine.recover()
        if not engine.tags:
            raise InvalidInput(f"store {store.root} has no registered tags: give a source to mount")
        if spec.page_size:
            for plan in plans:
                engine.write_identity_pagemap(engine.tags[plan.ctx.dst], spec.page_size)
    except BaseException:
        store.release()
        raise
    return engine, mountpoint


def run(spec: MountSpec, config: Config, options: SourceOptions, *,
        ready: Callable[[list[str], str], None]) -> None:
    """Prepare and serve until unmounted; ``ready(tags, mountpoint)`` once the mount answers."""
    from faultfs.fuse.serve import serve  # pyfuse3: only in the process that serves

    engine, mountpoint = prepare(spec, config, options)
    try:
        serve(engine, mountpoint, ready=lambda: ready(sorted(engine.tags), mountpoint),
              allow_other=spec.allow_other)
    finally:
        engine.store.release()
    log.info("unmounted %s", mountpoint)


def _unique(name: str, used: set[str]) -> str:
    if name not in used:
        return name
    n = 2
    while f"{name}-{n}" in used:
        n += 1
    return f"{name}-{n}"
