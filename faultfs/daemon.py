"""The composition root: a mount request and its configuration -> store (and the shared
store) -> sources -> tiers -> engine -> served tree.

Invariants:
- Nothing is persisted until every source of the request has been checked; a refused mount
  leaves the store's registrations as they were.
- The store is locked for as long as the engine lives; it is released however ``run`` ends.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from faultfs.config import Config
from faultfs.core.context import MAX_CHUNK_SIZE, FaultContext
from faultfs.core.names import check_tag_name
from faultfs.core.ownership import Ownership
from faultfs.core.pagemap import MAX_PAGE_SIZE
from faultfs.engine import Engine, default_tag_name
from faultfs.engine.sharing import SharedRegistry, publish_tags
from faultfs.errors import FaultfsError, InvalidInput
from faultfs.fuse.connection import mount_path
from faultfs.fuse.exporter import parse_addr
from faultfs.fuse.mountpoint import prepare_mountpoint
from faultfs.sources import SourceOptions, expand_sources
from faultfs.store.blobstore import BlobStore
from faultfs.tiers.claims import open_claims
from faultfs.tiers.objects import open_objects, probe
from faultfs.tiers.sealed import SealedObjects, load_key

if TYPE_CHECKING:
    from faultfs.fuse.handover import Handover

log = logging.getLogger("faultfs")
LOG_NAME = "faultfs.log"  # <store>/log/faultfs.log: the daemon's log


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
    ownership: Ownership | None = None  # --uid, --gid, --file-mode, --dir-mode, --umask

    def check(self) -> None:
        if self.tag is not None:
            check_tag_name(self.tag)
        if not 0 <= self.chunk_size <= MAX_CHUNK_SIZE:
            raise InvalidInput(f"chunk size {self.chunk_size} is not in [0, 1 GiB]")
        if self.page_size > MAX_PAGE_SIZE:
            raise InvalidInput(f"page size {self.page_size} is over the 1 GiB limit")


def prepare(spec: MountSpec, config: Config, options: SourceOptions, *,
            takeover: bool = False) -> tuple[Engine, str, list[str]]:
    """Everything a mount needs before it answers: store, lock, tags. Returns the engine (its
    store locked), the absolute mountpoint and warnings for the user (a degraded store).

    Everything that can be checked is checked before anything is written: a refused mount
    leaves no store directory, lock, log or registration behind. ``takeover``: the mount is
    there already, served by a daemon that is gone (fuse/holder.py)."""
    spec.check()
    if config.metrics_addr:
        parse_addr(config.metrics_addr)
    store = BlobStore(config.store_dir, create=False)
    store.direct = config.store_direct
    mountpoint, recovered = ((mount_path(spec.mountpoint), None) if takeover
                             else prepare_mountpoint(spec.mountpoint))
    # (not when taking a mount over: resolving the mountpoint would ask the mount, which
    # waits for this daemon; the first daemon checked it)
    if not takeover and _within(store.root, mountpoint):
        raise InvalidInput(f"store {store.root} is inside the mountpoint {mountpoint}: the mount "
                           "would hide it; pick a --store outside it")
    log_file = os.path.join(store.root, "log", LOG_NAME)
    if os.path.islink(log_file):
        raise InvalidInput(f"store log {log_file} is a symbolic link: faultfs does not follow "
                           "links inside its store", errno.ELOOP)
    existed = os.path.isdir(os.path.join(store.root, "tags"))
    sharing = open_sharing(config, options)  # before anything is written: it may refuse
    if not spec.sources and not existed and not (sharing and sharing.entries):
        raise InvalidInput(f"store {store.root} has no registered tags: give a source to mount"
                           + (f" (the shared store {sharing.url} has none either)"
                              if sharing else ""))
    if existed:  # lock an existing store before reading it (its lock file is there already)
        store.create()
        store.acquire()
    problems = _Problems()  # what recovery found wrong: the user hears it at mount
    logging.getLogger("faultfs").addHandler(problems)
    try:
        engine = Engine(store, config, options, sharing=sharing)
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
        if sharing is not None:
            for plan in plans:
                sharing.check(plan.ctx)  # a tag name another node's context owns
        if not existed:
            store.create()
            store.acquire()
        if sharing is not None:
            imported = sharing.import_into(store, {p.ctx.dst for p in plans})
            if imported:
                log.info("tags from the shared store %s: %s", sharing.url, ", ".join(imported))
        # A URL with credentials in it (userinfo, a presigned query) was opened as given; the
        # context that is persisted and hashed names it with those values as *** (the registry
        # never holds a secret). The real URL lives only in the opened source, in memory: a
        # remount without the source cannot re-open it (docs/sources.md, "Secrets").
        for shard, plan in enumerate(plans):
            engine.commit_plan(plan, shard=shard)
        engine.recover()
        if not engine.tags:
            raise InvalidInput(f"store {store.root} has no registered tags: give a source to mount")
        if sharing is not None:
            publish_tags(sharing, store, [t.ctx for t in engine.tags.values()])
        warnings = ([recovered] if recovered else []) + problems.lines()
        if store.degraded:
            warnings.append(f"store {store.root} cannot be written ({store.degraded}): serving "
                            "what is staged, reading the rest through from the sources"
                            + ("; writes get ENOSPC until space returns, then are taken and "
                               "faults stored again" if store.full else ""))
            log.warning("%s", warnings[-1])
        if spec.page_size and not takeover:
            for plan in plans:
                try:
                    engine.write_identity_pagemap(engine.tags[plan.ctx.dst], spec.page_size)
                except FaultfsError as exc:
                    if not store.degraded:
                        raise
                    warnings.append(f"tag {plan.ctx.dst}: no identity pagemap ({exc.message})")
    except BaseException:
        store.release()
        raise
    finally:
        logging.getLogger("faultfs").removeHandler(problems)
    return engine, mountpoint, warnings


class _Problems(logging.Handler):
    """Errors logged while a mount is prepared (damaged user data, a tag that cannot come
    back), kept to be shown to the user as warnings of the mount."""

    MOST = 10

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []
        self.more = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().splitlines()[0] if record.getMessage() else ""
        if text in self.seen:
            return
        if len(self.seen) < self.MOST:
            self.seen.append(text)
        else:
            self.more += 1

    def lines(self) -> list[str]:
        return self.seen + ([f"... and {self.more} more (see the store's log)"]
                            if self.more else [])


def open_sharing(config: Config, options: SourceOptions) -> SharedRegistry | None:
    """The shared store of ``--shared-store``, checked (listed, written, read) and its
    registry fetched; None without one. One line of InvalidInput when it cannot be used."""
    if not config.shared_store:
        return None
    key = load_key(config.shared_store_key) if config.shared_store_key else None
    objects = SealedObjects(open_objects(config.shared_store, options,
                                         endpoint_url=config.shared_store_endpoint_url), key)
    probe(objects)
    sharing = SharedRegistry(objects)
    sharing.claim_store, sharing.mode_note = open_claims(objects, enabled=config.shared_claims)
    log.info("%s", sharing.mode_note)
    try:
        sharing.fetch()
    except OSError as exc:
        raise InvalidInput(f"shared store {objects.url} cannot be read: "
                           f"{exc.strerror or exc}", errno.EIO) from None
    return sharing


def run(spec: MountSpec, config: Config, options: SourceOptions, *,
        ready: Callable[[list[str], str, list[str]], None], log_to_store: bool = False,
        held: Handover | None = None) -> None:
    """Prepare and serve until unmounted; ``ready(tags, mountpoint, warnings)`` once the
    mount answers. ``log_to_store``: the daemon's log (and stderr) move to the store's log.
    ``held``: a holder keeps the mount (fuse/holder.py); a standby daemon waits for its word
    before it opens the store (the daemon it replaces holds it)."""
    from faultfs.fuse.serve import serve  # pyfuse3: only in the process that serves

    if held is not None and held.standby and not held.wait_go():
        log.debug("the holder went away before this daemon took over: exiting")
        return
    engine, mountpoint, warnings = prepare(spec, config, options,
                                           takeover=held is not None and held.takeover)
    try:
        if log_to_store:
            attach_store_log(engine.store)
        notes = [engine.sharing.mode_note] if engine.sharing is not None else []
        serve(engine, mountpoint,
              ready=lambda: ready(sorted(engine.tags), mountpoint, warnings, notes),
              allow_other=spec.allow_other, ownership=spec.ownership, held=held)
    finally:
        engine.store.release()
    if held is not None and held.handing_over:
        log.info("handed the mount at %s over to a new daemon", mountpoint)
    else:
        log.info("unmounted %s", mountpoint)


def attach_store_log(store: BlobStore) -> None:
    """Send stderr (and so the log) to ``<store>/log/faultfs.log``: created 0600, appended,
    never through a symbolic link. A degraded store keeps the log where it was."""
    if store.degraded:
        return
    path = os.path.join(store.root, "log", LOG_NAME)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                     | os.O_NONBLOCK, 0o600)
    except OSError as exc:
        log.warning("cannot log to %s (%s): logging to stderr", path, exc.strerror)
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            log.warning("%s is not a regular file: logging to stderr", path)
            return
        os.fchmod(fd, 0o600)  # an older faultfs made it 0644
        _carry_early_log(fd)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _carry_early_log(fd: int) -> None:
    """What the daemon logged before its store's log existed (recovery's warnings: a
    damaged write state, a tag that cannot come back) went to a private temporary stderr:
    append it to the log, so it is not lost with that file."""
    try:
        st = os.fstat(2)
        if stat.S_ISREG(st.st_mode) and st.st_size:
            os.write(fd, os.pread(2, min(st.st_size, 1 << 20), 0))
    except OSError:
        pass


def _within(path: str, directory: str) -> bool:
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _unique(name: str, used: set[str]) -> str:
    if name not in used:
        return name
    n = 2
    while f"{name}-{n}" in used:
        n += 1
    return f"{name}-{n}"
