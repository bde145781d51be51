"""The walk over a store no mount owns: every entry of it, verified and classified, as one
stream of findings — the registry first (what the later passes need to know), then the
tags' directories, the writes and the journal, then the temp files at the root.

Invariants:
- Memory is bounded by the number of tags, never by the number of blobs: each pass streams
  its directories and hands its findings on as it makes them.
- Nothing is changed unless the caller drops a finding (``StoreWalk.drop``), and a finding
  with a ``keep`` reason is never dropped; an orphaned tag's emptied directory goes only
  once something was dropped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from faultfs.store.entries import remove_entry
from faultfs.store.fsck.blobs import BlobReader
from faultfs.store.fsck.findings import Finding
from faultfs.store.fsck.look import scan, temp_finding
from faultfs.store.fsck.registry import KnownTags
from faultfs.store.fsck.tags import TagDirs
from faultfs.store.fsck.writes import WriteDirs

PROBE_PREFIX = ".probe-"  # BlobStore.create's writability probe, left by a crash


class StoreWalk:
    """Every entry of the store, verified and classified, as a stream of ``Finding``s.

    ``verify``: read every payload and check every block, the whole-payload checksum and the
    pagemap (fsck); without it only headers are read (gc). The caller may ``drop`` each
    finding as it receives it; an orphaned tag's emptied directory then goes too."""

    def __init__(self, root: str, *, verify: bool = True) -> None:
        self.root = root
        self._blobs = BlobReader(verify=verify)
        self._known = KnownTags(os.path.join(root, "tags"), self._blobs)
        self._writes = os.path.join(root, "writes")
        self._pruning = False  # something was dropped: emptied orphaned directories go too

    @property
    def verify(self) -> bool:
        return self._blobs.verify

    def __iter__(self) -> Iterator[Finding]:
        yield from self._known.findings()
        yield from TagDirs(self._known, self._blobs, self._prune).findings()
        yield from WriteDirs(self._writes, self._known, self._blobs).findings()
        yield from self._root_pass()

    def drop(self, finding: Finding, *, dry_run: bool = False) -> int:
        """Remove the entry of ``finding`` (whatever it is, never following a link); the bytes
        it held. ``dry_run``: only say so."""
        if finding.keep:
            raise ValueError(f"{finding.path} is kept: {finding.keep}")
        if dry_run:
            finding.action = "would drop"
            return finding.size
        remove_entry(finding.path)
        finding.action = "dropped"
        self._pruning = True
        return finding.size

    def _prune(self, directory: str) -> None:
        if self._pruning:
            try:
                os.rmdir(directory)
            except OSError:
                pass  # not empty: something in it is kept

    def _root_pass(self) -> Iterator[Finding]:
        for entry in scan(self.root):
            if entry.name.startswith(PROBE_PREFIX):
                yield temp_finding(entry.path)
