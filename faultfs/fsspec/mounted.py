"""The tags a mount registered in a store, as seen by the protocol (DESIGN §18): an object
opened through ``faultfs::`` that a mount of the same store has registered — the same
source, cut the same way, pinned at the same version — reads the chunks the mount staged as
hits (no second source read, no second copy).

Invariants:
- Only a plain mount tag qualifies: binary format, the whole object from offset 0, the same
  chunk size, not a clone; and only while its tag state names the version this object is
  pinned at (the version is the guard: two sources under one URL with one version are one
  object).
- A mount blob is served only when its header verifies, is clean (a dirty blob holds a
  user's writes, not the source's bytes) and names that version. Nothing of the mount's is
  written or replaced from here, and only a clean blob that fails verification is removed
  (as the mount's own read would): a blob that does not qualify is a miss, and the chunk is
  faulted into the protocol's own tag.
- The index is read again when the registry's directory changes (a tag registered or
  forgotten); a tag state is read at each pin (a mount that re-pinned its source).
"""

from __future__ import annotations

import os
import threading

from faultfs.core.context import REGISTRY_TAG, FaultContext
from faultfs.errors import CorruptionError
from faultfs.sources.base import local_path
from faultfs.store.blobstore import BlobStore, OpenBlob
from faultfs.store.registry import Registry
from faultfs.store.tagstate import read_tag_state

BINARY_DEFAULT_CHUNK = 1 << 20  # a context's chunk size 0: the binary format's default

# (source as the mount names it, chunk size) -> the mount's tags of it, with their contexts
Index = dict[tuple[str, int], list[FaultContext]]


def same_source(url: str) -> str:
    """A source URL as both a mount's context and the protocol name it (a local file by its
    path, with or without ``file://``)."""
    path = local_path(url)
    return os.path.abspath(path) if path is not None else url


class MountBlob:
    """Where chunk ``index`` of an object stands in a mount's tag."""

    def __init__(self, store: BlobStore, tag: str, prefix: str, version: str) -> None:
        self.store = store
        self.tag = tag
        self.prefix = prefix
        self.version = version

    def name(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def path(self, index: int) -> str:
        return self.store.blob_path(self.tag, self.name(index))

    def open(self, index: int) -> OpenBlob | None:
        """The mount's clean blob of chunk ``index`` staged from the pinned version, or None.
        Opened without a version to check (that check deletes a stale blob: not ours to
        delete) and judged here."""
        try:
            blob = self.store.open_blob(self.tag, self.name(index))
        except (CorruptionError, OSError):
            return None  # a damaged dirty blob raises: the mount's to report
        if blob is None:
            return None
        header = blob.header
        if header.dirty or header.source_version != self.version:
            blob.close()
            return None
        return blob


class MountTags:
    """The store's mount tags by source and chunk size (blocking: file I/O)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self._registry = Registry(store)
        self._lock = threading.Lock()
        self._seen: tuple[int, int] | None = None
        self._index: Index = {}

    def find(self, url: str, size: int, chunk_size: int, version: str) -> MountBlob | None:
        """The mount tag holding ``url`` at ``version`` cut in ``chunk_size`` chunks, or
        None."""
        for ctx in self._current().get((same_source(url), chunk_size), ()):
            if ctx.range_size not in (0, size):
                continue
            state = read_tag_state(self.store, ctx.dst)
            if state is not None and state.source_version == version:
                return MountBlob(self.store, ctx.dst, ctx.blob_prefix, version)
        return None

    def _current(self) -> Index:
        try:
            st = os.stat(self.store.tag_dir(REGISTRY_TAG))
        except OSError:
            return {}  # no registry: no mount has used this store
        seen = (st.st_mtime_ns, st.st_ino)
        with self._lock:
            if seen != self._seen:
                self._index = self._read()
                self._seen = seen
            return self._index

    def _read(self) -> Index:
        index: Index = {}
        for entry in self._registry.entries():
            if not isinstance(entry, tuple):
                continue  # a damaged entry: the mount reports it
            ctx = entry[1]
            if ctx.format != "binary" or ctx.range_off != 0 or ctx.src_data:
                continue  # another cut, a range, a clone
            key = (same_source(ctx.src), ctx.chunk_size or BINARY_DEFAULT_CHUNK)
            index.setdefault(key, []).append(ctx)
        return index
