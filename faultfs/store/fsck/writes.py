"""The writes' directories as the walk checks them: each tag's write state (``state.json``),
its dirty files (``b-``/``h-``) and the direct files of whole-chunk writes not folded yet
(``d-<seq>``), the blobs a write state names damaged, what a mount kept aside
(``writes/damaged/``), and the journal (``segments.py``).

Invariants:
- Nothing here is ever dropped: every finding of dirty data, a write state or the journal
  carries a ``keep`` reason.
- A dirty file verifies like a blob, is flagged dirty, names a journal position, and belongs
  to its tag or one of the ancestors its write state names (a clone's linked files); a
  direct file names its own seq.
- A write state is judged by the mount's own parser (``store/writestate.py``): what fsck
  calls fine a mount reads, and a damaged one is named in the same words.
- The journal is walked first: a direct file that no record the replay reaches names is the
  file of a whole-chunk write that was never answered (its record never appended, or cut off
  with a torn tail) or one a checkpoint let go, which the next mount deletes whatever it
  holds — a ``LEFTOVER``, not damage (a kill -9 in the middle of one left it torn or empty).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from faultfs.store.dirty import DIRECT_PREFIX, WAL_PREFIX
from faultfs.store.dirty import STATE as WRITE_STATE
from faultfs.store.entries import encode_component, real_dir
from faultfs.store.fsck.blobs import BlobReader, blob_name
from faultfs.store.fsck.findings import (
    DAMAGED,
    DIRTY,
    JOURNAL,
    KEEP_DIRTY,
    KEEP_JOURNAL,
    LEFTOVER,
    OK,
    ORPHANED,
    WRITE_STATES,
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
from faultfs.store.fsck.segments import JournalWalk
from faultfs.store.journal import DAMAGED_DIR
from faultfs.store.writestate import problem as write_state_problem


class WriteDirs:
    """The findings of ``writes/``: every tag's writes, the journal, what a mount kept."""

    def __init__(self, writes_dir: str, known: KnownTags, blobs: BlobReader) -> None:
        self._writes = writes_dir
        self._known = known
        self._blobs = blobs
        self._journal = JournalWalk(os.path.join(writes_dir, "journal"))

    def findings(self) -> Iterator[Finding]:
        if os.path.lexists(self._writes) and not real_dir(self._writes):
            mode, size = lsize(self._writes)
            yield Finding(WRITE_STATES, DAMAGED, self._writes, size,
                          f"{kind(mode)} stands where the writes' directory should be",
                          KEEP_DIRTY)
            return
        journal = os.path.join(self._writes, "journal")
        if real_dir(journal):  # first: which direct files its records name
            yield from self._journal.findings()
        for entry in scan(self._writes):
            if entry.name == DAMAGED_DIR and entry.is_dir(follow_symlinks=False):
                for kept in scan(entry.path):
                    _, size = lsize(kept.path)
                    yield Finding(JOURNAL, DAMAGED, kept.path, size,
                                  "kept by a mount: writes it could not replay or fold (see the "
                                  "store's log); remove it by hand once not needed",
                                  KEEP_JOURNAL)
                continue
            if entry.name == "journal":
                if not entry.is_dir(follow_symlinks=False):
                    mode, size = lsize(entry.path)
                    yield Finding(JOURNAL, DAMAGED, entry.path, size,
                                  f"{kind(mode)} stands where the journal's directory should be",
                                  KEEP_JOURNAL)
                continue
            tag = self._known.tag_of(entry.name)
            if not entry.name.startswith(("t-", "h-")) or (tag is None and entry.name.startswith("t-")):
                yield unknown_finding(entry.path)
            elif not entry.is_dir(follow_symlinks=False):
                mode, size = lsize(entry.path)
                yield Finding(WRITE_STATES, DAMAGED, entry.path, size,
                              f"{kind(mode)} stands where the writes of tag {tag or entry.name} "
                              "should be", KEEP_DIRTY)
            else:
                yield from self._write_dir(entry.path, entry.name, tag)

    def _write_dir(self, directory: str, dirname: str, tag: str | None) -> Iterator[Finding]:
        label = tag if tag is not None else dirname
        orphan = "" if tag is not None and tag in self._known.by_tag else (
            f"tag {label} has no registry entry")
        state_path = os.path.join(directory, WRITE_STATE)
        ancestors: tuple[str, ...] = ()
        if os.path.lexists(state_path):
            _, size = lsize(state_path)
            doc, problem = read_json(state_path)
            if doc is not None:
                problem = write_state_problem(doc)  # the mount's own parser
                if not problem:
                    ancestors = tuple(doc.get("ancestors", ()))
            subject = f"write state of {label}"
            if problem:
                yield Finding(WRITE_STATES, DAMAGED, state_path, size, f"{subject}: {problem}",
                              KEEP_DIRTY)
            elif orphan:
                yield Finding(WRITE_STATES, ORPHANED, state_path, size, f"{subject}: {orphan}",
                              KEEP_DIRTY)
            else:
                yield Finding(WRITE_STATES, OK, state_path, size)
            for name, mark in ({} if problem or doc is None else
                               doc.get("damaged_blobs", {})).items():
                yield Finding(DIRTY, DAMAGED, state_path, 0,
                              f"dirty blob {name} of tag {label}: {mark['reason']}: it reads as "
                              "EIO until faultfs reset drops its writes", KEEP_DIRTY)

        def owns(header_tag: str) -> bool:
            if header_tag in ancestors:
                return True
            return header_tag == tag if tag is not None else (
                encode_component("t-", header_tag) == dirname)

        for entry in scan(directory):
            if entry.name == WRITE_STATE:
                continue
            if is_temp(entry.name):
                yield temp_finding(entry.path)
            elif entry.name.startswith(("b-", "h-")):
                yield self._dirty_file(entry, label, owns, orphan)
            elif (seq := _direct_seq(entry.name)) is not None:
                if tag is not None and not orphan and (tag, seq) not in (
                        self._journal.blob_records):
                    _, size = lsize(entry.path)
                    yield Finding(DIRTY, LEFTOVER, entry.path, size,
                                  f"the file of a whole-chunk write of tag {label} that no "
                                  f"record of the journal names (seq {seq}: never answered, "
                                  "or let go by a checkpoint): the next mount deletes it",
                                  KEEP_DIRTY)
                else:
                    yield self._dirty_file(entry, label, owns, orphan, direct=True)
            else:
                yield unknown_finding(entry.path)

    def _dirty_file(self, entry: os.DirEntry, label: str, owns: Callable[[str], bool],
                    orphan: str, *, direct: bool = False) -> Finding:
        """A dirty file, or (``direct``) a whole-chunk write's ``d-<seq>`` file that the
        next mount folds: the same format, naming that seq."""
        path = entry.path
        name, hashed = (None, True) if direct else blob_name(entry.name)
        if name is None and not hashed:
            return unknown_finding(path)
        _, size = lsize(path)
        blob = self._blobs.read(path, owners=owns, name=name)
        header = blob.header
        problem = blob.problem
        if header is not None and not problem:
            if direct and header.source_version != f"{WAL_PREFIX}{_direct_seq(entry.name)}":
                problem = f"names another journal position ({header.source_version!r})"
            elif not direct and hashed and encode_component("b-", header.name) != entry.name:
                problem = f"holds blob {header.name!r}, which is not named so"
            elif not header.dirty:
                problem = "is not flagged dirty"
            elif not (header.source_version.startswith(WAL_PREFIX)
                      and header.source_version[len(WAL_PREFIX):].isdigit()):
                problem = f"names no journal position ({header.source_version!r})"
        shown = name or (header.name if header is not None else entry.name)
        subject = f"dirty blob {shown} of tag {label}"
        if problem:
            return Finding(DIRTY, DAMAGED, path, size, f"{subject}: {problem}", KEEP_DIRTY)
        if orphan:
            return Finding(DIRTY, ORPHANED, path, size, f"{subject}: {orphan}", KEEP_DIRTY)
        return Finding(DIRTY, OK, path, size)


def _direct_seq(name: str) -> int | None:
    """The seq a direct file's name (``d-<16 hex>``) gives, None for any other name."""
    digits = name[len(DIRECT_PREFIX):]
    if not name.startswith(DIRECT_PREFIX) or len(digits) != 16:
        return None
    try:
        return int(digits, 16)
    except ValueError:
        return None

