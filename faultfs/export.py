"""export: a tag's current bytes (its source with every write laid over it) as one file, at a
local path or any fsspec URL, with a progress bar; a local export resumes where it stopped.

Invariants:
- The bytes are read through the mount's whole-object view, so they are exactly what a
  reader of the view sees now.
- A local export checkpoints its position (``<DEST>.faultfs-export.meta``, the ping-pong
  format) only after the bytes before it were fsynced to DEST, and names what it exported
  (tag, size, mtime): a resume of another state of the tag starts over. A finished export
  removes its checkpoint.
- An existing DEST is never overwritten unless it is the export being resumed, or
  ``force`` is given.
- A remote DEST (an fsspec URL) is written in one stream; an interrupted one starts over.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import TextIO

from faultfs.control_client import split_tag_dir
from faultfs.core.coord import StreamCoordinate
from faultfs.core.names import CTL_NAME
from faultfs.errors import FaultfsError, InvalidInput, SourceError
from faultfs.progress import ProgressBar
from faultfs.sources import local_path

BLOCK = 8 << 20  # bytes read from the view and written per step
CHECKPOINT_BYTES = 256 << 20  # a local export checkpoints (after an fsync) this often
STATE_SUFFIX = ".faultfs-export.meta"


@dataclass
class ExportReport:
    dest: str
    size: int = 0
    written: int = 0
    resumed_from: int = 0
    seconds: float = 0.0


def view_of(tag_dir: str) -> tuple[str, dict]:
    """The path of a tag's whole-object view, and the tag's entry of the mount's stats."""
    root, tag = split_tag_dir(tag_dir)
    try:
        with open(os.path.join(root, CTL_NAME, "stats"), "rb") as f:
            stats = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise FaultfsError(f"cannot read the stats of the mount at {root}: {exc}") from None
    entry = stats.get("tags", {}).get(tag)
    if entry is None:
        raise InvalidInput(f"the mount at {root} has no tag {tag!r}", errno.ENOENT)
    return os.path.join(root, tag, entry["view_name"]), entry


def export(tag_dir: str, dest: str, *, force: bool = False, progress: bool = True,
           storage_options: dict | None = None, out: TextIO | None = None) -> ExportReport:
    view, _ = view_of(tag_dir)
    size = os.path.getsize(view)
    mark = zlib.crc32(f"{os.path.basename(tag_dir)}:{size}:{os.stat(view).st_mtime_ns}".encode())
    report = ExportReport(dest, size)
    started = time.monotonic()
    bar = ProgressBar(out or sys.stderr, "export", size) if progress else None
    path = local_path(dest)
    with open(view, "rb", buffering=0) as src:
        if path is None:
            _export_remote(src, dest, size, report, bar, storage_options or {}, force)
        else:
            _export_local(src, os.path.abspath(path), size, mark, report, bar, force)
    if bar:
        bar.finish(report.written + report.resumed_from)
    report.seconds = time.monotonic() - started
    return report


def _copy(src, size: int, start: int, write, report: ExportReport, bar, on_block=None) -> None:
    pos = start
    while pos < size:
        data = os.pread(src.fileno(), min(BLOCK, size - pos), pos)
        if not data:
            raise SourceError(f"the view ended at {pos} of {size} bytes")
        write(pos, data)
        pos += len(data)
        report.written += len(data)
        if on_block is not None:
            on_block(pos)
        if bar:
            bar.update(pos)


def _export_local(src, dest: str, size: int, mark: int, report: ExportReport, bar,
                  force: bool) -> None:
    from faultfs.store.metadata import DualMetadataManager  # numpy: only when exporting

    state = dest + STATE_SUFFIX
    resuming = os.path.exists(state)
    if os.path.exists(dest) and not resuming and not force:
        raise InvalidInput(f"{dest} exists: give --force to replace it", errno.EEXIST)
    with DualMetadataManager.open(state) as meta:
        start = 0
        coord = meta.coord
        if not meta.is_fresh and coord.page_idx == mark and coord.global_row_idx == size:
            start = min(coord.byte_offset, size)
        report.resumed_from = start
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | (0 if start else os.O_TRUNC), 0o644)
        try:
            batch = meta.committed_batch_id
            last = start

            def checkpoint(pos: int) -> None:
                nonlocal batch, last
                if pos - last >= CHECKPOINT_BYTES or pos == size:
                    os.fsync(fd)  # the bytes first, then the position that vouches for them
                    batch += 1
                    meta.commit(batch, StreamCoordinate(byte_offset=pos, page_idx=mark,
                                                        global_row_idx=size))
                    last = pos

            _copy(src, size, start, lambda off, data: _pwrite_all(fd, data, off), report, bar,
                  checkpoint)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
    for leftover in (state, state + ".dedup"):
        if os.path.exists(leftover):
            os.unlink(leftover)


def _pwrite_all(fd: int, data: bytes, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n


def _export_remote(src, dest: str, size: int, report: ExportReport, bar, options: dict,
                   force: bool) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(dest, **options)
    if fs.exists(path) and not force:
        raise InvalidInput(f"{dest} exists: give --force to replace it", errno.EEXIST)
    with fs.open(path, "wb") as f:
        _copy(src, size, 0, lambda off, data: f.write(data), report, bar)
