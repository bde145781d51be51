"""DualMetadataManager: the crash-safe ping-pong checkpoint (``X.meta``) and its dedup WAL
(``X.meta.dedup``) for stream and warm cursors.

Invariants (DESIGN §9, docs/FORMAT-cursors.md):
- ``X.meta`` is always exactly 128 bytes: slot A at 0..64, slot B at 64..128. It is created
  whole (temp file, fsync, rename, directory fsync), never grown in place, holding an all-zero
  slot A and the genesis slot (epoch 0, nothing committed) in slot B.
- The WAL holds 8-byte little-endian xxh3_64 hashes; only the first ``dedup_count`` of the
  active slot are committed. Opening truncates it to exactly ``dedup_count * 8`` bytes.
- A commit appends its hashes to the WAL and fsyncs it *before* it writes the new slot, and
  writes the slot for epoch ``e`` at the parity position (odd → A, even → B) so the slot of
  epoch ``e - 1`` is never touched: a crash at any point leaves the previous commit or the
  new one, never anything else.
- All file access goes through a ``FileOps`` seam (``os.pread``/``os.pwrite`` by default), so
  tests can replace it with a disk that forgets or tears unsynced writes at a "crash".
- An ``exclusive`` opener (a RecordStream) holds an exclusive ``flock`` on ``X.meta`` until it
  closes, taken before anything is read or the WAL cut: a second exclusive opener, in this
  process or another, is refused and changes nothing. Two writers of one checkpoint would
  overwrite each other's slots and WAL entries, and records one had committed would come again.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from faultfs.core.coord import U32_MAX, StreamCoordinate
from faultfs.core.slots import (
    META_SIZE,
    SLOT_A_OFFSET,
    SLOT_B_OFFSET,
    SLOT_SIZE,
    DiskSlot,
    SlotReading,
    SlotStatus,
    decode_slot,
    slot_offset_for_epoch,
)
from faultfs.errors import CorruptionError, InvalidInput, SourceError
from faultfs.store.fileops import FileOps, OsFileOps

HASH_SIZE = 8  # one little-endian xxh3_64 per WAL entry
WAL_SUFFIX = ".dedup"  # X.meta -> X.meta.dedup, the name the original engine uses
_HASH_DTYPE = np.dtype("<u8")
_FRESH = DiskSlot(0, 0, StreamCoordinate(), 0)  # the state before the first commit (genesis)


@dataclass(frozen=True)
class Recovery:
    """Which slot a .meta file resumes from and why."""

    slot: DiskSlot  # the fresh all-zero state when active is None
    active: str | None  # "A", "B" or None (fresh)
    reason: str


def choose_active(a: SlotReading, b: SlotReading) -> Recovery:
    """The recovery rule of DESIGN §9 over the two slot readings; CorruptionError otherwise.

    - both valid: the higher epoch wins; equal epochs are corruption;
    - one valid: it wins (its partner was torn by a crash, or was never written);
    - both all-zero: fresh;
    - anything else (no valid slot in a non-zero file): corruption.
    A valid slot must sit at its epoch's parity position (odd → A, even → B). Epoch 0 is the
    *genesis* slot that ``open`` writes into slot B of a new file, so that even a torn first
    commit (epoch 1, slot A) falls back to a valid partner instead of looking like corruption.
    """
    if a.slot is not None and b.slot is not None and a.slot.epoch == b.slot.epoch:
        raise CorruptionError(f"both slots hold epoch {a.slot.epoch}")
    for name, reading, offset in (("A", a, SLOT_A_OFFSET), ("B", b, SLOT_B_OFFSET)):
        slot = reading.slot
        if slot is None:
            continue
        if slot_offset_for_epoch(slot.epoch) != offset:
            home = "A" if slot_offset_for_epoch(slot.epoch) == SLOT_A_OFFSET else "B"
            raise CorruptionError(f"slot {name} holds epoch {slot.epoch}, which belongs in slot {home}")
    if a.slot is not None and b.slot is not None:
        if a.slot.epoch > b.slot.epoch:
            return Recovery(a.slot, "A", f"higher epoch ({a.slot.epoch} > {b.slot.epoch})")
        return Recovery(b.slot, "B", f"higher epoch ({b.slot.epoch} > {a.slot.epoch})")
    if a.slot is not None:
        return Recovery(a.slot, "A", f"slot B is {b.describe()}")
    if b.slot is not None:
        if b.slot.epoch == 0:
            return Recovery(b.slot, None, f"genesis slot B: fresh (slot A is {a.describe()})")
        return Recovery(b.slot, "B", f"slot A is {a.describe()}")
    if a.status is SlotStatus.ALL_ZERO and b.status is SlotStatus.ALL_ZERO:
        return Recovery(_FRESH, None, "both slots all-zero: fresh")
    raise CorruptionError(
        f"no valid slot: slot A is {a.describe()}, slot B is {b.describe()}"
    )


def read_meta(meta_path: str, ops: FileOps | None = None) -> tuple[SlotReading, SlotReading]:
    """Read and judge both slots of an existing .meta file (which must be 128 bytes)."""
    ops = ops or OsFileOps()
    try:
        fd = ops.open(meta_path, os.O_RDONLY)
    except FileNotFoundError:
        raise SourceError(f"{meta_path}: no such checkpoint file", errno.ENOENT) from None
    try:
        size = ops.size(fd)
        if size != META_SIZE:
            raise CorruptionError(f"{meta_path}: .meta must be {META_SIZE} bytes, is {size}")
        data = ops.pread(fd, META_SIZE, 0)
    finally:
        ops.close(fd)
    return decode_slot(data[:SLOT_SIZE]), decode_slot(data[SLOT_SIZE:])


def _hold_exclusive(fd: int, path: str) -> None:
    """Take the exclusive ``flock`` of an opened ``.meta`` (see the module doc), or refuse. A
    file system without ``flock`` gives no such guard, as before."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise InvalidInput(
            f"{path}: checkpoint is open in another stream (this process or another); two "
            "writers would overwrite each other's commits: close the other one first",
            errno.EBUSY,
        ) from None
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


class DualMetadataManager:
    """An open checkpoint: the active slot's fields, and ``commit`` to write the next one."""

    def __init__(
        self, meta_path: str, ops: FileOps, meta_fd: int, wal_fd: int, recovery: Recovery
    ) -> None:
        self.meta_path = meta_path
        self.wal_path = meta_path + WAL_SUFFIX
        self._ops = ops
        self._meta_fd = meta_fd
        self._wal_fd = wal_fd
        self._slot = recovery.slot
        self.recovery = recovery

    # -- recovery --------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        meta_path: str | os.PathLike[str],
        *,
        ops: FileOps | None = None,
        exclusive: bool = False,
    ) -> DualMetadataManager:
        """Open or create ``meta_path`` (and its WAL) and recover the last commit.
        ``exclusive``: hold ``meta_path`` against every other exclusive opener until
        ``close`` (real files only: the lock is a ``flock`` on the descriptor)."""
        path = os.fspath(meta_path)
        ops = ops or OsFileOps()
        directory = os.path.dirname(os.path.abspath(path))
        wal_path = path + WAL_SUFFIX
        # what exists is judged before anything is made: a refused open changes nothing
        created = not ops.exists(path)
        if created:
            cls._check_orphan_wal(path, wal_path, ops)
            cls._create_meta(path, ops)
        meta_fd = wal_fd = -1
        try:
            meta_fd = ops.open(path, os.O_RDWR)
            if exclusive:
                _hold_exclusive(meta_fd, path)
            size = ops.size(meta_fd)
            if size != META_SIZE:
                raise CorruptionError(f"{path}: .meta must be {META_SIZE} bytes, is {size}")
            data = ops.pread(meta_fd, META_SIZE, 0)
            try:
                recovery = choose_active(decode_slot(data[:SLOT_SIZE]), decode_slot(data[SLOT_SIZE:]))
            except CorruptionError as err:
                raise CorruptionError(f"{path}: {err.message}") from None
            if not ops.exists(wal_path):
                created = True
            wal_fd = ops.open(wal_path, os.O_RDWR | os.O_CREAT)
            if created:
                # the new names must survive a crash before the first commit relies on them
                ops.fsync_dir(directory)
            committed_bytes = recovery.slot.dedup_count * HASH_SIZE
            wal_size = ops.size(wal_fd)
            if wal_size < committed_bytes:
                raise CorruptionError(
                    f"{wal_path}: dedup WAL is {wal_size} bytes but the checkpoint commits "
                    f"{recovery.slot.dedup_count} hashes ({committed_bytes} bytes)"
                )
            if wal_size > committed_bytes:
                # hashes appended by a commit whose slot never landed: not committed
                ops.ftruncate(wal_fd, committed_bytes)
                ops.fsync(wal_fd)
        except BaseException:
            if meta_fd >= 0:
                ops.close(meta_fd)
            if wal_fd >= 0:
                ops.close(wal_fd)
            raise
        return cls(path, ops, meta_fd, wal_fd, recovery)

    @staticmethod
    def _check_orphan_wal(path: str, wal_path: str, ops: FileOps) -> None:
        """Before a fresh ``.meta`` is made: a WAL already there must commit nothing (empty).
        A commit fsyncs the ``.meta``'s name before its first hash, so hashes without a
        ``.meta`` are a checkpoint that lost its ``.meta``, never a crash's leftover: a fresh
        start would cut them and deliver their records again."""
        if not ops.exists(wal_path):
            return
        fd = ops.open(wal_path, os.O_RDONLY)
        try:
            size = ops.size(fd)
        finally:
            ops.close(fd)
        if size:
            raise CorruptionError(
                f"{wal_path}: dedup WAL holds {size} bytes but its checkpoint {path} is "
                "missing; restore the checkpoint, or remove the WAL to start over"
            )

    @staticmethod
    def _create_meta(path: str, ops: FileOps) -> None:
        """Create a fresh 128-byte .meta atomically (no crash leaves another size): slot A
        all-zero, slot B the genesis slot."""
        tmp = path + ".tmp"
        fd = ops.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        try:
            ops.pwrite(fd, bytes(SLOT_SIZE) + _FRESH.encode(), 0)
            ops.fsync(fd)
        finally:
            ops.close(fd)
        ops.rename(tmp, path)

    # -- the active commit -----------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._slot.epoch

    @property
    def committed_batch_id(self) -> int:
        return self._slot.committed_batch_id

    @property
    def coord(self) -> StreamCoordinate:
        return self._slot.coord

    @property
    def dedup_count(self) -> int:
        return self._slot.dedup_count

    @property
    def slot(self) -> DiskSlot:
        return self._slot

    @property
    def is_fresh(self) -> bool:
        return self._slot.epoch == 0

    def committed_hashes(self, start: int = 0) -> np.ndarray:
        """The committed hashes from the ``start``-th on, in commit order, as a fresh
        ``uint64`` array (read from the WAL; nothing before ``start`` is read)."""
        self._check_open()
        start = min(max(start, 0), self._slot.dedup_count)
        count = self._slot.dedup_count - start
        data = self._ops.pread(self._wal_fd, count * HASH_SIZE, start * HASH_SIZE)
        if len(data) != count * HASH_SIZE:
            raise CorruptionError(f"{self.wal_path}: short read of committed hashes")
        return np.frombuffer(data, dtype=_HASH_DTYPE).astype(np.uint64)

    # -- commit ----------------------------------------------------------------------------

    def commit(
        self,
        batch_id: int,
        coord: StreamCoordinate,
        new_hashes: Sequence[int] | np.ndarray = (),
        *,
        journal: Callable[[DiskSlot], None] | None = None,
    ) -> DiskSlot:
        """Durably record: batches up to ``batch_id`` consumed, resume at ``coord``, and
        ``new_hashes`` committed after the existing ones. Returns the new active slot.

        ``journal``: another file that makes the new slot durable (a shuffled stream's
        record, which carries a copy of it): called with the slot after the WAL's fsync and
        before the slot is written here, which then takes no fsync of its own — whoever
        opens the checkpoint puts the journal's copy back first if a power loss took it."""
        self._check_open()
        hashes = np.asarray(new_hashes, dtype=_HASH_DTYPE).ravel()
        new_count = self._slot.dedup_count + int(hashes.size)
        if new_count > U32_MAX:
            raise InvalidInput(
                f"dedup WAL would hold {new_count} hashes; the slot format allows {U32_MAX}"
            )
        slot = DiskSlot(self._slot.epoch + 1, batch_id, coord, new_count)  # range-checks
        if hashes.size:
            offset = self._slot.dedup_count * HASH_SIZE
            self._write_all(self._wal_fd, hashes.tobytes(), offset)
            self._ops.fsync(self._wal_fd)
        if journal is not None:
            journal(slot)
        self._write_all(self._meta_fd, slot.encode(), slot.offset)
        if journal is None:
            self._ops.fsync(self._meta_fd)
        self._slot = slot
        self.recovery = Recovery(slot, "A" if slot.offset == SLOT_A_OFFSET else "B", "committed")
        return slot

    def _write_all(self, fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            n = self._ops.pwrite(fd, bytes(view), offset)
            if n <= 0:
                raise OSError(errno.EIO, "short write")
            view = view[n:]
            offset += n

    def _check_open(self) -> None:
        if self._meta_fd < 0:
            raise InvalidInput(f"{self.meta_path}: checkpoint is closed")

    def close(self) -> None:
        if self._meta_fd >= 0:
            self._ops.close(self._meta_fd)
            self._ops.close(self._wal_fd)
            self._meta_fd = self._wal_fd = -1

    def __enter__(self) -> DualMetadataManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
