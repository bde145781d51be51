"""export: a tag's current bytes (its source with every write laid over it) as one file, at a
local path or any fsspec URL, with a progress bar; a local export resumes where it stopped.

Invariants:
- The bytes are read through the mount's whole-object view, so they are exactly what a
  reader of the view sees now.
- A local export checkpoints its position (``<DEST>.faultfs-export.meta``, the ping-pong
  format) only after the bytes before it were fsynced to DEST, and names what it exported
  (tag, size, mtime): a resume of another state of the tag starts over, and so does one
  whose DEST is shorter than the checkpoint (deleted or cut since; a checkpoint extends
  DEST to its position first). A finished export removes its checkpoint.
- An existing DEST is never overwritten unless it is the export being resumed, or
  ``force`` is given.
- An S3 DEST (``s3://``) is a multipart upload: its upload id, the tag's mark and the part
  size are kept in a local state file (``$XDG_STATE_HOME/faultfs/exports``, written
  atomically) before the first part; a resume asks S3 which parts it holds and uploads the
  rest; the upload is completed only once every part is in, so DEST never shows a partial
  object. A resume of another state of the tag aborts the old upload and starts over.
- Any other remote DEST (an fsspec URL) is written in one stream; an interrupted one starts
  over.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import TextIO

from faultfs.buffers import pread_bytes
from faultfs.control_client import split_tag_dir
from faultfs.core.coord import StreamCoordinate
from faultfs.core.names import CTL_NAME
from faultfs.errors import FaultfsError, InvalidInput, SourceError
from faultfs.progress import ProgressBar
from faultfs.sources import SourceOptions, local_path
from faultfs.store.blobfile import is_all_zero
from faultfs.store.durable import write_atomic, write_parts

BLOCK = 8 << 20  # bytes read from the view and written per step
CHECKPOINT_BYTES = 256 << 20  # a local export checkpoints (after an fsync) this often
STATE_SUFFIX = ".faultfs-export.meta"
PART_BYTES = 64 << 20  # an S3 export's parts (at least this; 10,000 at most)
MAX_PARTS = 10_000  # S3's limit on the parts of one upload


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
        if path is None and dest.startswith(("s3://", "s3a://")):
            _export_s3(src, dest, size, mark, report, bar, storage_options or {}, force)
        elif path is None:
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
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):  # said of DEST, not of the checkpoint made beside it
        raise InvalidInput(f"{dest}: the directory {parent} does not exist", errno.ENOENT)
    if os.path.isdir(dest):
        raise InvalidInput(f"{dest} is a directory: give the path of the file to write",
                           errno.EISDIR)
    resuming = os.path.exists(state)
    if os.path.exists(dest) and not resuming and not force:
        raise InvalidInput(f"{dest} exists: give --force to replace it", errno.EEXIST)
    with DualMetadataManager.open(state) as meta:
        start = 0
        coord = meta.coord
        if not meta.is_fresh and coord.page_idx == mark and coord.global_row_idx == size:
            start = min(coord.byte_offset, size)
        if start and _length(dest) < start:
            start = 0  # DEST was deleted or cut since: the checkpoint vouches for nothing
        report.resumed_from = start
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | (0 if start else os.O_TRUNC), 0o644)
        try:
            # past the vouched bytes the file holds nothing: a block of zeros is left a hole
            # (a view grown far out exports as a sparse file, as cp --sparse=auto makes it)
            os.ftruncate(fd, start)
            batch = meta.committed_batch_id
            last = start

            def checkpoint(pos: int) -> None:
                nonlocal batch, last
                if pos - last >= CHECKPOINT_BYTES or pos == size:
                    # DEST reaches the position (a hole past the last bytes written, when the
                    # view had zeros there), so a resume tells a DEST cut since by its length
                    os.ftruncate(fd, pos)
                    os.fsync(fd)  # the bytes first, then the position that vouches for them
                    batch += 1
                    meta.commit(batch, StreamCoordinate(byte_offset=pos, page_idx=mark,
                                                        global_row_idx=size))
                    last = pos

            def write(off: int, data: bytes) -> None:
                if not is_all_zero(data):
                    write_parts(fd, [data], at=off)

            _copy(src, size, start, write, report, bar, checkpoint)
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
    for leftover in (state, state + ".dedup"):
        if os.path.exists(leftover):
            os.unlink(leftover)


def _length(path: str) -> int:
    """The size of the file at ``path``; -1 when there is none."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _export_remote(src, dest: str, size: int, report: ExportReport, bar, options: dict,
                   force: bool) -> None:
    import fsspec

    fs, path = fsspec.core.url_to_fs(dest, **options)
    if fs.exists(path) and not force:
        raise InvalidInput(f"{dest} exists: give --force to replace it", errno.EEXIST)
    with fs.open(path, "wb") as f:
        _copy(src, size, 0, lambda off, data: f.write(data), report, bar)


def _export_s3(src, dest: str, size: int, mark: int, report: ExportReport, bar,
               options: dict, force: bool) -> None:
    from faultfs.sources.filesystems import filesystem_for, s3_client

    fs, path = filesystem_for(dest, SourceOptions(storage_options=options))
    bucket, _, key = path.partition("/")
    if not bucket or not key:
        raise InvalidInput(f"{dest} names no object (s3://BUCKET/KEY)")
    client = s3_client(fs)
    state_path = remote_state_path(dest)
    state = _read_state(state_path)
    if state is not None and (state.get("mark"), state.get("size")) != (mark, size):
        _abort(client, bucket, key, state)  # another state of the tag: start over
        state = None
    done: dict[int, str] = {}
    if state is not None:
        try:
            done = _uploaded(client, bucket, key, str(state["upload"]), int(state["part"]), size)
        except _UploadGone:  # aborted by a lifecycle rule or by hand: start over
            state = None
    if state is None:
        if fs.exists(path) and not force:
            raise InvalidInput(f"{dest} exists: give --force to replace it", errno.EEXIST)
        if size == 0:
            client.put_object(Bucket=bucket, Key=key, Body=b"")
            return
        part = max(PART_BYTES, -(-size // MAX_PARTS))
        upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        state = {"dest": dest, "mark": mark, "size": size, "part": part, "upload": upload}
        _write_state(state_path, state)
    part, upload = int(state["part"]), str(state["upload"])
    count = -(-size // part)
    first = 1
    while first in done:
        first += 1
    report.resumed_from = min((first - 1) * part, size)
    if bar:
        bar.update(report.resumed_from)
    for number in range(first, count + 1):
        lo = (number - 1) * part
        data = _read_range(src, lo, min(part, size - lo))
        done[number] = _upload_part(client, bucket, key, upload, number, data)
        report.written += len(data)
        if bar:
            bar.update(lo + len(data))
    client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload,
        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": done[n]} for n in range(1, count + 1)]})
    os.unlink(state_path)


class _UploadGone(Exception):
    pass


def remote_state_path(dest: str) -> str:
    """Where the state of an export to ``dest`` is kept (one file per destination)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    digest = hashlib.sha256(dest.encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return os.path.join(base, "faultfs", "exports", f"{digest}.json")


def _read_state(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(1 << 16))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return None  # damaged: the upload it named is left to the bucket's lifecycle rules
    ok = isinstance(doc, dict) and all(isinstance(doc.get(k), int) and doc[k] >= 0
                                       for k in ("mark", "size", "part"))
    return doc if ok and doc["part"] > 0 and isinstance(doc.get("upload"), str) else None


def _write_state(path: str, state: dict) -> None:
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    write_atomic(path, [json.dumps(state).encode()], mode=0o600)


def _uploaded(client, bucket: str, key: str, upload: str, part: int, size: int) -> dict[int, str]:
    """The parts S3 holds of ``upload`` whole (their ETags by number); _UploadGone when S3
    no longer knows the upload."""
    done: dict[int, str] = {}
    marker = 0
    while True:
        try:
            page = client.list_parts(Bucket=bucket, Key=key, UploadId=upload,
                                     PartNumberMarker=marker)
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code in ("NoSuchUpload", "404"):
                raise _UploadGone() from None
            raise FaultfsError(f"listing the parts of the export to s3://{bucket}/{key} "
                               f"failed: {exc}") from None
        for p in page.get("Parts", []):
            number = int(p["PartNumber"])
            if int(p["Size"]) == min(part, size - (number - 1) * part):
                done[number] = str(p["ETag"])
        if not page.get("IsTruncated"):
            return done
        marker = int(page["NextPartNumberMarker"])


def _upload_part(client, bucket: str, key: str, upload: str, number: int, data: bytes) -> str:
    return str(client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                  Body=data)["ETag"])


def _abort(client, bucket: str, key: str, state: dict) -> None:
    try:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=str(state["upload"]))
    except Exception:  # gone already: nothing to abort
        pass


def _read_range(src, off: int, size: int) -> bytes:
    data = pread_bytes(src.fileno(), size, off)
    if len(data) != size:
        raise SourceError(f"the view ended at {off + len(data)} of {off + size} bytes")
    return data
