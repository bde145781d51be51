"""warm: resumable eager ingest of a mounted faultfs — read every blob of a tag (or of every tag
of a mount) that is not yet staged, with a progress bar, checkpointing where it is so that an
interrupted warm resumes there.

Invariants:
- The tree is DESIGN §7: a mount root holds ``.faultfs/`` and one directory per tag; a tag holds
  blobs named ``<prefix><index>`` plus views that are not blobs (``page:N``, ``.pagemap``, the
  whole-object view). The blobs of a tag are its regular files whose names end in a decimal
  index and share the tag's most common prefix, warmed in index order; tags in name order.
- A blob is staged iff the mount says so: one ``staged`` request per tag through
  ``.faultfs/control`` (a bitmap of its chunks), else the blob's ``user.faultfs.staged``
  attribute (mounts with ``--xattrs``), else ``st_blocks`` (which cannot say it exactly: the
  mount reports at least one block for every non-empty file, so archivers never take unread
  data for a hole; fully allocated means staged). Staged blobs are skipped without being read. Warming reads the whole blob in large ``pread``s into one
  reused buffer: the read faults it in and the mount stores it.
- The checkpoint is a DualMetadataManager coordinate: ``shard_id`` = tag index, ``byte_offset``
  = index of the next blob of that tag, ``page_idx`` = the tag's name as 32 bits (``tag_mark``:
  a resume finds the tag by name, also after tags were added or forgotten), ``global_row_idx``
  = blobs done (read or skipped) since the warm began. It is committed every ``checkpoint_blobs`` blobs or ``checkpoint_seconds``,
  at the end of each tag, and on an interrupt or error; a kill -9 loses at most one interval.
  A checkpoint past the last tag means the previous warm completed: the next one starts over.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import re
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TextIO

import xxhash

from faultfs.control_client import request
from faultfs.core.coord import StreamCoordinate
from faultfs.core.names import CTL_NAME, PAGE_PREFIX, XATTR_STAGED
from faultfs.errors import FaultfsError, InvalidInput, SourceError
from faultfs.progress import ProgressBar

CONTROL_DIR = CTL_NAME  # the mount's control directory: stats and registry, never warmed
READ_SIZE = 1 << 20  # one pread per MiB: large enough to stream, small enough to share a pool
CHECKPOINT_BLOBS = 64  # blobs between checkpoints: bounds re-reading after a kill -9
CHECKPOINT_SECONDS = 5.0  # ...and time between them, for large blobs
_INDEXED_NAME = re.compile(r"^(.*?)(\d+)$")

BlobReader = Callable[[str, int, bytearray], int]


@dataclass(frozen=True)
class Blob:
    tag_idx: int
    index: int
    path: str
    size: int
    staged: bool


@dataclass
class WarmReport:
    target: str
    state_path: str
    tags: int = 0
    blobs_total: int = 0
    blobs_warmed: int = 0
    blobs_skipped: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    resumed_from: StreamCoordinate | None = None
    completed: bool = False
    notes: list[str] = field(default_factory=list)


def default_state_path(target: str | os.PathLike[str]) -> str:
    """``<store>/warm/<xxh3 of the target's real path>.meta`` for a mounted faultfs (the
    checkpoint lives with the blobs it describes), else under ``$XDG_CACHE_HOME/faultfs``."""
    real = os.path.realpath(os.fspath(target))
    key = xxhash.xxh3_64_hexdigest(os.fsencode(real))
    for root in (real, os.path.dirname(real)):
        try:
            with open(os.path.join(root, CONTROL_DIR, "stats"), "rb") as f:
                store = json.loads(f.read()).get("store")
        except (OSError, ValueError):
            continue
        if isinstance(store, str) and os.path.isdir(store):
            return os.path.join(store, "warm", f"{key}.meta")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "faultfs", f"warm-{key}.meta")


def resolve_tags(target: str | os.PathLike[str]) -> list[str]:
    """The tag directories ``target`` names: all tags of a mount root, or one tag."""
    path = os.path.abspath(os.fspath(target))
    if not os.path.isdir(path):
        raise InvalidInput(f"{path}: not a directory", errno.ENOTDIR)
    if os.path.isdir(os.path.join(path, CONTROL_DIR)):
        with os.scandir(path) as entries:
            return sorted(
                e.path
                for e in entries
                if not e.name.startswith(".") and e.is_dir(follow_symlinks=False)
            )
    if os.path.isdir(os.path.join(os.path.dirname(path), CONTROL_DIR)):
        return [path]
    raise InvalidInput(
        f"{path}: not a faultfs mount or tag directory (no {CONTROL_DIR}/ in it or its parent)"
    )


def tag_blobs(tag_dir: str) -> list[tuple[int, str]]:
    """``(index, path)`` of the blobs of a tag, in index order (see the module invariants)."""
    by_prefix: dict[str, list[tuple[int, str]]] = {}
    with os.scandir(tag_dir) as entries:
        for e in entries:
            if e.name.startswith((".", PAGE_PREFIX)) or not e.is_file(follow_symlinks=False):
                continue
            m = _INDEXED_NAME.match(e.name)
            if m:
                by_prefix.setdefault(m.group(1), []).append((int(m.group(2)), e.path))
    if not by_prefix:
        return []
    counts = Counter({p: len(v) for p, v in by_prefix.items()})
    # the blob prefix is the most common; a tie goes to the one that has blob 0
    prefix = max(counts, key=lambda p: (counts[p], any(i == 0 for i, _ in by_prefix[p]), p))
    return sorted(by_prefix[prefix])


def staged_chunks(tag_dir: str) -> tuple[str, int, bytes] | None:
    """The mount's answer for the tag at ``tag_dir``: ``(chunk name prefix, chunks, bitmap)``,
    or None when it gives none (not a faultfs mount that takes requests, or an older one)."""
    root, tag = os.path.split(os.path.abspath(tag_dir).rstrip("/"))
    try:
        answer = request(root, {"op": "staged", "tag": tag})
        prefix, chunks = answer["prefix"], answer["chunks"]
        bitmap = base64.b64decode(answer["bitmap"], validate=True)
    except (FaultfsError, OSError, KeyError, TypeError, ValueError):
        return None
    if not isinstance(prefix, str) or not isinstance(chunks, int) or len(bitmap) * 8 < chunks:
        return None
    return prefix, chunks, bitmap


def chunk_staged(answer: tuple[str, int, bytes] | None, index: int, path: str) -> bool | None:
    """What ``answer`` (``staged_chunks``) says of blob ``index`` at ``path``; None when it
    says nothing of it (not a chunk of the tag: another prefix, or past its chunks)."""
    if answer is None:
        return None
    prefix, chunks, bitmap = answer
    if os.path.basename(path) != f"{prefix}{index}" or index >= chunks:
        return None
    return bool(bitmap[index >> 3] >> (index & 7) & 1)


def is_staged(path: str, st: os.stat_result) -> bool:
    """Whether the mount holds ``path``'s bytes already, asked of the blob itself (see the
    module invariants)."""
    try:
        return os.getxattr(path, XATTR_STAGED) == b"1"
    except OSError:
        return st.st_size > 0 and st.st_blocks * 512 >= st.st_size


def read_whole_blob(path: str, size: int, buf: bytearray) -> int:
    """Read ``path`` to its end with large preads into ``buf``; the bytes read."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        offset = 0
        view = memoryview(buf)
        while True:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                return offset
            offset += n
    finally:
        os.close(fd)


def _plan(tags: list[str], start: StreamCoordinate) -> list[Blob]:
    blobs = []
    for tag_idx in range(start.shard_id, len(tags)):
        answer = staged_chunks(tags[tag_idx])
        for index, path in tag_blobs(tags[tag_idx]):
            if tag_idx == start.shard_id and index < start.byte_offset:
                continue  # done before the checkpoint
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue  # vanished since listing (e.g. evicted and forgotten)
            staged = chunk_staged(answer, index, path)
            if staged is None:
                staged = is_staged(path, st)
            blobs.append(Blob(tag_idx, index, path, st.st_size, staged))
    return blobs


def _blobs_note(done: int, total: int, skipped: int) -> str:
    return f"blobs {done}/{total} ({skipped} staged)"


def tag_mark(tag_dir: str) -> int:
    """A tag's name as 32 bits for the checkpoint (never 0: 0 is "no tag recorded")."""
    return zlib.crc32(os.fsencode(os.path.basename(tag_dir))) | 1


def _at(tags: list[str], tag_idx: int, blob: int, done: int) -> StreamCoordinate:
    """The coordinate of blob ``blob`` of tag ``tag_idx``: ``page_idx`` names the tag, so a
    resume finds it again when tags were added or forgotten meanwhile."""
    mark = tag_mark(tags[tag_idx]) if tag_idx < len(tags) else 0
    return StreamCoordinate(shard_id=tag_idx, byte_offset=blob, page_idx=mark,
                            global_row_idx=done)


def _follow_tag(tags: list[str], start: StreamCoordinate, report: WarmReport) -> StreamCoordinate:
    """Where a checkpoint resumes in today's tag list: at the tag it names, wherever that tag
    sorts now; from the start when that tag is gone (its blobs staged since are skipped)."""
    if not start.page_idx:  # written before tags were named: trust the position
        report.resumed_from = start
        return start
    for idx, tag in enumerate(tags):
        if tag_mark(tag) == start.page_idx:
            if idx != start.shard_id:
                report.notes.append(f"tags changed since the checkpoint: resuming at "
                                    f"{os.path.basename(tag)} (now tag {idx})")
            moved = replace(start, shard_id=idx)
            report.resumed_from = moved
            return moved
    report.notes.append("the tag the previous warm was in is gone; starting over")
    return StreamCoordinate()


def warm(
    target: str | os.PathLike[str],
    state_path: str | os.PathLike[str] | None = None,
    progress: bool = True,
    *,
    checkpoint_blobs: int = CHECKPOINT_BLOBS,
    checkpoint_seconds: float = CHECKPOINT_SECONDS,
    read_blob: BlobReader = read_whole_blob,
    out: TextIO | None = None,
) -> WarmReport:
    """Warm ``target`` (a mount root or a tag directory), resuming from ``state_path``."""
    if checkpoint_blobs < 1:
        raise InvalidInput(f"checkpoint_blobs must be >= 1, got {checkpoint_blobs}")
    tags = resolve_tags(target)
    state = os.fspath(state_path) if state_path is not None else default_state_path(target)
    os.makedirs(os.path.dirname(os.path.abspath(state)), exist_ok=True)
    report = WarmReport(os.fspath(target), state, tags=len(tags))
    started = time.monotonic()
    from faultfs.store.fileops import OsFileOps
    from faultfs.store.metadata import DualMetadataManager  # numpy: only when warming

    # the default checkpoint lies in the store: opened as the store's files are, never
    # through a link (one given by the user is theirs to place)
    in_store = None if state_path is not None else OsFileOps(links=False,
                                                             what="warm checkpoint")
    with DualMetadataManager.open(state, ops=in_store) as meta:
        start = meta.coord
        if meta.is_fresh:
            start = StreamCoordinate()
        elif start.shard_id >= len(tags):
            report.notes.append("the previous warm completed; starting over")
            start = StreamCoordinate()
        else:
            start = _follow_tag(tags, start, report)
        blobs = _plan(tags, start)
        report.blobs_total = len(blobs)
        bar = (
            ProgressBar(out or sys.stderr, "warm", sum(b.size for b in blobs if not b.staged))
            if progress
            else None
        )
        done = 0
        position = start
        batch = meta.committed_batch_id
        last_commit_done, last_commit_time = 0, time.monotonic()

        def checkpoint(coord: StreamCoordinate) -> None:
            nonlocal batch, last_commit_done, last_commit_time
            if coord == meta.coord:
                return
            batch += 1
            meta.commit(batch, coord)
            last_commit_done, last_commit_time = done, time.monotonic()

        buf = bytearray(READ_SIZE)
        try:
            for i, blob in enumerate(blobs):
                if blob.staged:
                    report.blobs_skipped += 1
                else:
                    try:
                        report.bytes_read += read_blob(blob.path, blob.size, buf)
                    except OSError as err:
                        raise SourceError(
                            f"{blob.path}: warm read failed: {err.strerror or err}",
                            err.errno or errno.EIO,
                        ) from err
                    report.blobs_warmed += 1
                done += 1
                position = _at(tags, blob.tag_idx, blob.index + 1, start.global_row_idx + done)
                next_tag = blobs[i + 1].tag_idx if i + 1 < len(blobs) else len(tags)
                if next_tag != blob.tag_idx:
                    position = _at(tags, blob.tag_idx + 1, 0, position.global_row_idx)
                    checkpoint(position)
                elif (
                    done - last_commit_done >= checkpoint_blobs
                    or time.monotonic() - last_commit_time >= checkpoint_seconds
                ):
                    checkpoint(position)
                if bar:
                    bar.update(report.bytes_read, _blobs_note(done, len(blobs), report.blobs_skipped))
            position = _at(tags, len(tags), 0, start.global_row_idx + done)
            checkpoint(position)
            report.completed = True
        finally:
            if not report.completed:
                checkpoint(position)  # an interrupt or error keeps the progress made
            if bar:
                bar.finish(report.bytes_read, _blobs_note(done, len(blobs), report.blobs_skipped))
            report.seconds = time.monotonic() - started
    return report
