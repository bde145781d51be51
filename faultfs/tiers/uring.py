"""Staged reads through io_uring, driven from the trio thread: a read that misses the page
cache neither blocks the serving thread nor hops to a worker thread.

A read is queued on the ring and submitted with one ``io_uring_enter``, which completes it at
once when its bytes are in the page cache. Otherwise the reader parks, the kernel reads the
blocks in the background (ext4 and most local file systems take buffered reads without a
kernel worker thread), and the completion makes the ring's descriptor readable: one trio
system task waits for that (``trio.lowlevel.wait_readable``, like an eventfd but without the
extra descriptor and its read per wake-up), reaps every completion and wakes their readers.
So the disk reads of several readers are in flight at once, served by one thread.

The ring is the raw system calls (``io_uring_setup``/``io_uring_enter``) over ctypes and the
mmap'ed queues: no compiled dependency. ``open_ring`` checks that it works on the running
kernel (a read of a memfd through it) and returns None otherwise, saying why once in the log
(an old kernel, ``kernel.io_uring_disabled``, a seccomp filter, another architecture); the
caller then takes the blocking path (``tiers/local/``). ``FAULTFS_URING=0`` (``Config.uring``) turns it off.

Invariants:
- A buffer (and a path) handed to the kernel stays referenced until its completion is reaped.
- A waiting read cannot be cancelled (the kernel would write into a buffer that is gone): a
  cancellation takes effect once the read is done, within one disk read.
- A ring belongs to one trio run (its reaper is a system task of that run); a reader of
  another run gets ``usable() == False`` and takes the blocking path.
- The queues are shared with the kernel without locks or explicit barriers: only on x86-64,
  whose ordering of plain loads and stores (TSO) is all the protocol needs; elsewhere no ring.
- After an unexpected error of ``io_uring_enter`` the ring is never used again (``broken``);
  whatever the kernel might still write into stays referenced for the life of the process.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import struct
from typing import Any

import trio

from faultfs.buffers import address_of

log = logging.getLogger("faultfs.tiers")

# -- the kernel's interface (include/uapi/linux/io_uring.h) ------------------------------------

SYS_SETUP, SYS_ENTER = 425, 426  # the same numbers on every architecture
OFF_SQ_RING, OFF_SQES = 0, 0x10000000
FEAT_SINGLE_MMAP, FEAT_NODROP = 1, 2
ENTER_GETEVENTS = 1
SETUP_CLAMP = 1 << 4
SETUP_SUBMIT_ALL = 1 << 7
SETUP_COOP_TASKRUN = 1 << 8  # a completion does not interrupt the thread: it is taken at its
#                              next system call (this thread makes one per request anyway)
OP_OPENAT, OP_READ = 18, 22
SQE_ASYNC = 1 << 4  # IOSQE_ASYNC: the kernel's worker thread makes the call (see RingReader)
AT_FDCWD = -100

_PARAMS = struct.Struct("<10I" + "7IIQ" + "8IQ")  # io_uring_params: 120 bytes
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")  # 64 bytes
_CQE = struct.Struct("<QiI")  # 16 bytes
assert _PARAMS.size == 120 and _SQE.size == 64 and _CQE.size == 16

ENTRIES = 256  # submission queue entries (the completion queue gets twice as many)
MAX_IN_FLIGHT = ENTRIES  # more reads at once wait for a slot
SETUP_FLAGS = SETUP_CLAMP | SETUP_SUBMIT_ALL | SETUP_COOP_TASKRUN


class RingUnavailable(Exception):
    """io_uring cannot be used here; the message says why."""


def _make_syscall() -> Any:
    fn = ctypes.CDLL(None, use_errno=True).syscall
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long] * 7
    return fn


_syscall: Any = None


class Ring:
    """One io_uring instance: queue reads and opens, submit them, reap completions. No trio
    here; ``RingReader`` parks and wakes the readers."""

    def __init__(self, entries: int = ENTRIES, flags: int = SETUP_FLAGS) -> None:
        global _syscall
        if platform.machine() not in ("x86_64", "AMD64"):
            raise RingUnavailable(f"not used on {platform.machine()} (only x86-64 is checked)")
        if _syscall is None:
            _syscall = _make_syscall()
        self.enter = _syscall
        params = bytearray(_PARAMS.size)
        _PARAMS.pack_into(params, 0, 0, 0, flags, *([0] * 25))
        addr, anchor = address_of(params)
        fd = _syscall(SYS_SETUP, entries, addr, 0, 0, 0, 0)
        del anchor
        if fd < 0:
            err = ctypes.get_errno()
            why = " (sysctl kernel.io_uring_disabled?)" if err == errno.EPERM else ""
            raise RingUnavailable(f"io_uring_setup failed: {os.strerror(err)}{why}")
        self.fd = fd
        self._maps: list[mmap.mmap] = []
        self._u32: memoryview | None = None
        try:
            self._map(params)
        except BaseException:
            self.close()
            raise
        self.queued = 0

    def _map(self, params: bytearray) -> None:
        v = _PARAMS.unpack_from(params)
        sq_entries, cq_entries, features = v[0], v[1], v[5]
        sq_head, sq_tail, sq_mask, sq_array = v[10], v[11], v[12], v[16]
        cq_head, cq_tail, cq_mask, cq_cqes = v[19], v[20], v[21], v[24]
        if not features & FEAT_SINGLE_MMAP or not features & FEAT_NODROP:
            raise RingUnavailable("the kernel's io_uring is too old (no single mmap, no nodrop)")
        size = max(sq_array + 4 * sq_entries, cq_cqes + _CQE.size * cq_entries)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        rings = mmap.mmap(self.fd, size, flags=flags, prot=prot, offset=OFF_SQ_RING)
        self._maps.append(rings)
        sqes = mmap.mmap(self.fd, _SQE.size * sq_entries, flags=flags, prot=prot,
                         offset=OFF_SQES)
        self._maps.append(sqes)
        self._rings, self._sqes = rings, sqes
        u32 = self._u32 = memoryview(rings).cast("I")
        self.sq_entries = sq_entries
        self._sq_head, self._sq_tail = sq_head // 4, sq_tail // 4
        self._sq_mask = u32[sq_mask // 4]
        self._cq_head, self._cq_tail = cq_head // 4, cq_tail // 4
        self._cq_mask = u32[cq_mask // 4]
        self._cq_cqes = cq_cqes
        for i in range(sq_entries):  # the indirection array maps slot i to entry i, once
            u32[sq_array // 4 + i] = i
        self._tail = u32[self._sq_tail]  # ours; published to the kernel by submit()

    def prep(self, opcode: int, fd: int, addr: int, length: int, off: int, op_flags: int,
             user_data: int, sqe_flags: int = 0) -> None:
        """Queue one entry (the caller keeps fewer than ``sq_entries`` unsubmitted)."""
        _SQE.pack_into(self._sqes, (self._tail & self._sq_mask) * 64, opcode, sqe_flags, 0, fd,
                       off, addr, length, op_flags, user_data, 0, 0, 0, 0, 0)
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        self.queued += 1

    def submit(self, *, wait: int = 0) -> None:
        """Hand every queued entry to the kernel (and wait for ``wait`` completions)."""
        assert self._u32 is not None
        self._u32[self._sq_tail] = self._tail  # the entries are written: publish them
        n, self.queued = self.queued, 0
        flags = ENTER_GETEVENTS if wait else 0
        while True:
            ret = self.enter(SYS_ENTER, self.fd, n, wait, flags, 0, 0)
            if ret >= 0:
                n -= ret
                if n <= 0:
                    return
                continue
            err = ctypes.get_errno()
            if err not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def reap(self) -> list[tuple[int, int]]:
        """``(user_data, result)`` of every completion posted so far."""
        u32 = self._u32
        assert u32 is not None
        head = u32[self._cq_head]
        tail = u32[self._cq_tail]
        if head == tail:
            return []
        out = []
        mask, base, rings, unpack = self._cq_mask, self._cq_cqes, self._rings, _CQE.unpack_from
        while head != tail:
            user_data, res, _flags = unpack(rings, base + (head & mask) * 16)
            out.append((user_data, res))
            head = (head + 1) & 0xFFFFFFFF
        u32[self._cq_head] = head
        return out

    def close(self) -> None:
        if self._u32 is not None:
            self._u32.release()
            self._u32 = None
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class _Wait:
    """A reader's entries in flight: their results, and the task to wake once all are in."""

    __slots__ = ("anchors", "left", "results", "task")

    def __init__(self, n: int, anchors: Any) -> None:
        self.left = n
        self.results = [0] * n
        self.anchors = anchors  # the buffers and paths the kernel uses: alive until reaped
        self.task: Any = None


def _no_abort(_raise_cancel: Any) -> Any:
    return trio.lowlevel.Abort.FAILED  # the kernel still owns the buffer: finish first


class RingReader:
    """Reads and opens through a ``Ring`` from the trio thread (see the module docstring).
    Made inside the trio run that uses it."""

    def __init__(self, ring: Ring, *, punt_reads: bool = True) -> None:
        self.ring = ring
        # Reads go to the kernel's worker thread (SQE_ASYNC). Inline, a read that misses the
        # page cache starts its disk read inside io_uring_enter, on the serving thread (the
        # block layer and the virtual disk's doorbell: a VM exit per read here), which was a
        # fifth of that thread's time with 8 random readers; punted, the thread only queues.
        # Only while other entries are in flight: a lone reader waits for its one read, and
        # the hand-off to the worker would only add to that wait. A read is only sent to the
        # ring when the page cache likely lacks it (LocalTier).
        self._read_flags = SQE_ASYNC if punt_reads else 0
        self._ops: dict[int, tuple[_Wait, int]] = {}
        self._next = 1
        self._slots = trio.lowlevel.ParkingLot()
        self._token = trio.lowlevel.current_trio_token()
        self.submitted = 0  # entries handed to the kernel
        self.parked = 0  # readers that waited (their bytes were not in the page cache)
        self.broken = ""  # why the ring is no longer used (an unexpected error)
        self.closed = False
        trio.lowlevel.spawn_system_task(self._reap_loop, name="faultfs-uring-reaper")

    @property
    def in_flight(self) -> int:
        return len(self._ops)

    def usable(self) -> bool:
        """Whether the current task may use the ring (its trio run, not closed or broken)."""
        if self.closed or self.broken:
            return False
        try:
            return trio.lowlevel.current_trio_token() is self._token
        except RuntimeError:
            return False

    def run_over(self) -> bool:
        """Whether the trio run this reader belongs to has ended."""
        try:
            self._token.run_sync_soon(_nothing)
        except trio.RunFinishedError:
            return True
        return False

    async def read(self, fd: int, buf: Any, off: int) -> int:
        """Fill writable ``buf`` from ``fd`` at ``off``; the bytes read (fewer only at end of
        file). OSError as a pread would raise it."""
        want = len(buf)
        got = await self._one(OP_READ, fd, buf, want, off)
        if 0 < got < want:  # a short read before the end: the rest, as a pread would
            [more] = await self.read_many(fd, [memoryview(buf)[got:]], [off + got])
            got += more
        return got

    async def read_many(self, fd: int, bufs: list[Any], offs: list[int]) -> list[int]:
        """Fill each buffer of ``bufs`` from ``fd`` at the matching offset, all submitted at
        once; the bytes read into each (fewer only at end of file)."""
        views = [memoryview(b) for b in bufs]
        got = [0] * len(views)
        todo = list(range(len(views)))
        while todo:
            entries, anchors = [], []
            for i in todo:
                part = views[i][got[i]:]
                addr, anchor = address_of(part)
                anchors.append((anchor, part))
                entries.append((OP_READ, fd, addr, len(part), offs[i] + got[i], 0))
            results = await self._run(entries, anchors)
            left = []
            for i, res in zip(todo, results, strict=True):
                if res < 0:
                    raise OSError(-res, os.strerror(-res))
                got[i] += res
                if res and got[i] < len(views[i]):
                    left.append(i)
            todo = left
        return got

    async def openat(self, path: str, flags: int) -> int:
        """``os.open(path, flags)`` through the ring: the lookup and the inode's read happen
        off the serving thread."""
        raw = ctypes.create_string_buffer(os.fsencode(path))
        [res] = await self._run([(OP_OPENAT, AT_FDCWD, ctypes.addressof(raw), 0, 0, flags)],
                                raw)
        if res < 0:
            if -res == errno.ENOENT:
                raise FileNotFoundError(-res, os.strerror(-res), path)
            raise OSError(-res, os.strerror(-res), path)
        return res

    async def _one(self, opcode: int, fd: int, buf: Any, length: int, off: int) -> int:
        """One read into ``buf`` (the common case, kept short); its result or OSError."""
        if len(self._ops) >= MAX_IN_FLIGHT:
            await self._slot()
        anchor = ctypes.c_char.from_buffer(buf)
        ud = self._next
        self._next = ud + 1
        wait = _Wait(1, anchor)
        punt = self._punt()
        self._ops[ud] = (wait, 0)
        self.ring.prep(opcode, fd, ctypes.addressof(anchor), length, off, 0, ud,
                       punt if opcode == OP_READ else 0)
        self._submit()
        if wait.left:
            wait.task = trio.lowlevel.current_task()
            self.parked += 1
            await trio.lowlevel.wait_task_rescheduled(_no_abort)
        res = wait.results[0]
        if res < 0:
            raise OSError(-res, os.strerror(-res))
        return res

    async def _run(self, entries: list[tuple[int, int, int, int, int, int]],
                   anchors: Any) -> list[int]:
        """Submit ``entries`` (opcode, fd, address, length, offset, op flags) together and
        wait for all their results."""
        n = len(entries)
        while len(self._ops) + n > MAX_IN_FLIGHT:
            await self._slot()
        wait = _Wait(n, anchors)
        ud = self._next
        self._next = ud + n
        punt = self._punt()
        for i, (opcode, fd, addr, length, off, flags) in enumerate(entries):
            self.ring.prep(opcode, fd, addr, length, off, flags, ud + i,
                           punt if opcode == OP_READ else 0)
            self._ops[ud + i] = (wait, i)
        self._submit()
        if wait.left:
            wait.task = trio.lowlevel.current_task()
            self.parked += 1
            await trio.lowlevel.wait_task_rescheduled(_no_abort)
        return wait.results

    def _punt(self) -> int:
        """The entry flags of reads queued now (``SQE_ASYNC`` while others are in flight)."""
        return self._read_flags if self._ops else 0

    def _submit(self) -> None:
        ring = self.ring
        n = ring.queued
        try:
            ring.submit()
        except OSError as exc:
            self.broken = str(exc)  # the entries may be half taken: never touch it again
            _KEPT.append(self)  # whatever the kernel may still write into stays alive
            for wait, _i in list(self._ops.values()):
                if wait.task is not None:  # parked readers: fail them rather than hang
                    wait.results = [-errno.EIO] * len(wait.results)
                    trio.lowlevel.reschedule(wait.task)
                    wait.task = None
            self._ops.clear()
            log.error("io_uring failed (%s): staged reads take the blocking path from now "
                      "on", exc)
            raise
        self.submitted += n
        self._complete(ring.reap())  # those whose bytes were in the page cache

    async def _slot(self) -> None:
        await self._slots.park()

    def _complete(self, done: list[tuple[int, int]]) -> None:
        ops = self._ops
        for ud, res in done:
            entry = ops.pop(ud, None)
            if entry is None:
                continue
            wait, i = entry
            wait.results[i] = res
            wait.left -= 1
            if not wait.left and wait.task is not None:
                trio.lowlevel.reschedule(wait.task)
        if done and self._slots:
            self._slots.unpark_all()

    async def _reap_loop(self) -> None:
        ring = self.ring
        try:
            while not self.closed:
                await trio.lowlevel.wait_readable(ring.fd)  # completions are waiting
                self._complete(ring.reap())
        except trio.ClosedResourceError:
            return

    def close(self) -> None:
        """Wait (blocking) for entries still in flight, then close the ring."""
        if self.closed:
            return
        self.closed = True
        if self.broken:
            return  # kept as it is (``_KEPT``)
        ring = self.ring
        while self._ops:
            try:
                ring.submit(wait=1)
            except OSError:
                _KEPT.append(self)
                return
            for ud, _res in ring.reap():
                self._ops.pop(ud, None)
        try:
            trio.lowlevel.notify_closing(ring.fd)
        except RuntimeError:
            pass  # outside its run: nothing waits on it any more
        ring.close()


_KEPT: list[RingReader] = []  # rings that failed with entries in flight: never freed


class IdleProbe:
    """Whether the serving thread has nothing else to do at this moment, so one blocking read
    of the local disk costs it nothing it could have done meanwhile — and costs less than a
    ring entry, whose completion takes a wake-up, a poll and two task switches (about 20 µs
    of CPU here; docs/benchmarks.md, "Staged reads"). Otherwise a read goes through the ring
    and the thread goes on.

    "Something else" is a request waiting in the FUSE device this process serves (a
    descriptor of ``/dev/fuse``, found once in ``/proc/self/fd``, polled without waiting):
    with one reader there never is one (it waits for this reply); with several there
    usually is. Without such a descriptor (the engine used without a mount), another task
    ready to run counts instead."""

    def __init__(self) -> None:
        self._poll: Any = None
        self._looked = False

    def use(self, fd: int) -> None:
        """Poll ``fd`` for waiting requests instead (the fast read path's queue of requests
        for pyfuse3, when its threads read the device: ``fuse/fastread.py``)."""
        import select

        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._looked = True

    def idle(self) -> bool:
        if not self._looked:
            self._looked = True
            self._poll = _fuse_device_poll()
        if self._poll is None:
            try:
                return not trio.lowlevel.current_statistics().tasks_runnable
            except RuntimeError:
                return True
        return not self._poll.poll(0)


def fuse_device_fds() -> list[int]:
    """This process's open descriptors of ``/dev/fuse``, in order."""
    found: list[int] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                found.append(int(name))
        except (OSError, ValueError):
            continue
    return sorted(found)


def _fuse_device_poll() -> Any:
    """A ``select.poll`` over this process's ``/dev/fuse`` descriptors, or None."""
    import select

    found = fuse_device_fds()
    if not found:
        return None
    poll = select.poll()
    for fd in found:
        poll.register(fd, select.POLLIN)
    return poll


def _nothing() -> None:
    return None


def self_test(ring: Ring) -> None:
    """Reads of known bytes through ``ring``, made inline and by the kernel's worker
    (blocking); RingUnavailable if one fails."""
    data = b"faultfs io_uring check\n" * 8
    fd = os.memfd_create("faultfs-uring-check", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        bufs = [bytearray(len(data) + 16) for _ in range(2)]
        anchors = []
        for ud, (buf, flags) in enumerate(zip(bufs, (0, SQE_ASYNC), strict=True), start=1):
            addr, anchor = address_of(buf)
            anchors.append(anchor)
            ring.prep(OP_READ, fd, addr, len(buf), 0, 0, ud, flags)
        ring.submit(wait=2)
        done = sorted(ring.reap())
        while len(done) < 2:  # (wait=2 returns once both are in; a signal may cut it short)
            ring.submit(wait=2 - len(done))
            done = sorted(done + ring.reap())
        del anchors
    finally:
        os.close(fd)
    if done != [(1, len(data)), (2, len(data))] or any(bytes(b[:len(data)]) != data
                                                        for b in bufs):
        raise RingUnavailable(f"a read through io_uring came back wrong ({done})")


_told: set[str] = set()


def open_ring() -> Ring | None:
    """A working ring, or None (the reason logged once per process)."""
    try:
        ring = Ring()
    except (RingUnavailable, OSError) as exc:
        _tell(f"io_uring is not available ({exc}): staged reads that miss the page cache "
              "block the serving thread or go to the I/O pool")
        return None
    try:
        self_test(ring)
    except (RingUnavailable, OSError) as exc:
        ring.close()
        _tell(f"io_uring does not work here ({exc}): staged reads that miss the page cache "
              "block the serving thread or go to the I/O pool")
        return None
    return ring


def _tell(message: str) -> None:
    if message not in _told:
        _told.add(message)
        log.info("%s", message)
