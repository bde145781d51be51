"""What a mount's daemons pass to each other across a crash or an upgrade: the session state
(a memory file the holder keeps, ``SessionState``) and the descriptors and words exchanged with
the holder over a Unix socket (``HolderLink``). No pyfuse3 here: the holder imports it.

The kernel keeps everything else a replacement daemon must honour — the connection, node ids,
file handles, cached pages, locks, requests queued — as long as the holder keeps the
connection's ``/dev/fuse`` descriptor. Node ids are computed from names (``core/inodes``), so
they mean the same to every daemon; what is not derivable lives here:

- the FUSE_INIT request the connection was set up with (the kernel sends it once; a new daemon
  replays it to its own libfuse session, ``_fastread.c``'s ``takeover``);
- the open file handles: ``fh -> (inode, open flags)``, one 16-byte slot each, written before an
  open is answered and cleared when its release is; a new daemon re-opens every used slot;
- the answers to the last changing requests (write, truncate, create, unlink, rename): a
  request the dead daemon carried out but did not answer is resent by the kernel with the
  same unique (bit 63 set); the new daemon finds it here and answers it without doing it again;
- when the mount and the serving daemon started, and how many times the mount was taken over.

Invariants:
- A slot or an answer is written in an order a kill -9 at any instruction leaves readable: its
  payload first, its key (``used`` flag, unique) last.
- The state lives in memory only (a ``memfd``): a reboot ends the mount with it.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import socket
import struct
import time

MAGIC = b"FFSTATE1"
VERSION = 1
INIT_MAX = 256  # a FUSE_INIT request is 40 + 64 bytes
ANSWERS = 1024  # changing requests remembered (far more than can be in flight at a crash)
MAX_HANDLES = 1 << 20  # open file handles kept across a takeover (more: served, not kept)
_HEADER = struct.Struct("<8sIIQddQQQ")  # magic, version, init len, takeovers, mount started,
#                                         daemon started, handle high-water mark, answer count,
#                                         flags
_COUNT_AT = 8 + 4 + 4 + 8 + 8 + 8 + 8  # the answer count's place in the header
_INIT_AT = 128
_ANSWERS_AT = 4096
_ANSWER = struct.Struct("<Qq")  # unique (resend bit clear), result
_HANDLES_AT = _ANSWERS_AT + ANSWERS * _ANSWER.size
_SLOT = struct.Struct("<QII")  # inode, open flags, used
SIZE = _HANDLES_AT + MAX_HANDLES * _SLOT.size  # sparse: only touched pages cost memory
RESEND_BIT = 1 << 63  # the kernel marks a resent request's unique so (FUSE_UNIQUE_RESEND)
FLAG_RESEND = 1  # the kernel offered FUSE_HAS_RESEND at INIT
HAS_RESEND = 1 << 39  # fuse_init_in: flags | flags2 << 32


class SessionState:
    """The session state of one FUSE connection, over a memory file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._map = mmap.mmap(fd, SIZE)
        self._view = memoryview(self._map)
        magic, version = _HEADER.unpack_from(self._view)[:2]
        if magic == b"\0" * 8:
            _HEADER.pack_into(self._view, 0, MAGIC, VERSION, 0, 0, time.time(), 0.0, 0, 0, 0)
        elif magic != MAGIC or version != VERSION:
            raise ValueError(f"session state of another format ({magic!r} v{version})")
        self._answers = self._header()[7]  # one daemon writes at a time: counted here

    @classmethod
    def create(cls) -> SessionState:
        fd = os.memfd_create("faultfs-session", 0)  # inheritable: handed to each daemon
        os.ftruncate(fd, SIZE)
        return cls(fd)

    def close(self) -> None:
        self._view.release()
        self._map.close()

    # -- the header -------------------------------------------------------------------------

    def _header(self) -> list:
        return list(_HEADER.unpack_from(self._view))

    def _set(self, index: int, value) -> None:
        h = self._header()
        h[index] = value
        _HEADER.pack_into(self._view, 0, *h)

    @property
    def init(self) -> bytes | None:
        n = self._header()[2]
        return bytes(self._view[_INIT_AT:_INIT_AT + n]) if n else None

    def record_init(self, request: bytes) -> None:
        if len(request) > INIT_MAX:
            raise ValueError("FUSE_INIT request too long")
        self._view[_INIT_AT:_INIT_AT + len(request)] = request
        flags = 0
        if len(request) >= 40 + 20:
            low, high = struct.unpack_from("<II", request, 40 + 12)
            flags = FLAG_RESEND if (low | high << 32) & HAS_RESEND else 0
        self._set(8, flags)
        self._set(2, len(request))

    @property
    def resend(self) -> bool:
        """The kernel can resend what a dead daemon read and did not answer."""
        return bool(self._header()[8] & FLAG_RESEND)

    @property
    def takeovers(self) -> int:
        return self._header()[3]

    def taken_over(self) -> None:
        h = self._header()
        h[3] += 1
        h[5] = time.time()
        _HEADER.pack_into(self._view, 0, *h)

    def started(self) -> None:
        self._set(5, time.time())

    def describe(self) -> dict:
        """What ``faultfs stat`` shows of the session."""
        h = self._header()
        return {"takeovers": h[3], "mount_started": h[4], "daemon_started": h[5],
                "resend": bool(h[8] & FLAG_RESEND)}

    # -- answers to changing requests ---------------------------------------------------------

    def answered(self, unique: int, result: int) -> None:
        """``unique`` was carried out with ``result``; its reply is about to be sent."""
        n = self._answers
        at = _ANSWERS_AT + (n % ANSWERS) * _ANSWER.size
        _ANSWER.pack_into(self._view, at, 0, result)
        struct.pack_into("<Q", self._view, at, unique & ~RESEND_BIT)
        self._answers = n + 1
        struct.pack_into("<Q", self._view, _COUNT_AT, n + 1)

    def answer(self, unique: int) -> int | None:
        """The result of the resent request ``unique`` when it was carried out already."""
        if not unique & RESEND_BIT:
            return None
        want = unique & ~RESEND_BIT
        for i in range(ANSWERS):
            got, result = _ANSWER.unpack_from(self._view, _ANSWERS_AT + i * _ANSWER.size)
            if got == want:
                return result
        return None

    # -- file handles -------------------------------------------------------------------------

    def handles(self) -> list[tuple[int, int, int]]:
        """``(fh, inode, flags)`` of every handle the kernel holds open."""
        out = []
        for slot in range(self._header()[6]):
            inode, flags, used = _SLOT.unpack_from(self._view, _HANDLES_AT + slot * _SLOT.size)
            if used:
                out.append((slot + 1, inode, flags))
        return out

    def hold(self, fh: int, inode: int, flags: int) -> bool:
        """Record handle ``fh`` (1..MAX_HANDLES); False when it cannot be kept."""
        slot = fh - 1
        if not 0 <= slot < MAX_HANDLES:
            return False
        at = _HANDLES_AT + slot * _SLOT.size
        _SLOT.pack_into(self._view, at, inode, flags & 0xFFFFFFFF, 0)
        struct.pack_into("<I", self._view, at + 12, 1)
        if slot >= self._header()[6]:
            self._set(6, slot + 1)
        return True

    def let_go(self, fh: int) -> None:
        slot = fh - 1
        if 0 <= slot < MAX_HANDLES:
            struct.pack_into("<I", self._view, _HANDLES_AT + slot * _SLOT.size + 12, 0)


# -- the link between a daemon and its holder --------------------------------------------------

# words on the link, one JSON object a line; descriptors ride on the first byte of a message
ARMED = "armed"  # daemon -> holder (with the device and the log): the mount answers
READY = "ready"  # daemon -> holder: a takeover daemon serves the connection
STANDBY = "standby"  # daemon -> holder: loaded, waiting for "go" to take over
GO = "go"  # holder -> daemon: the old daemon is gone, take over now
HAND_OVER = "hand-over"  # holder -> daemon: stop serving, keep the mount, exit
BYE = "bye"  # daemon -> holder: the mount is ending (unmount): let the connection go


class HolderLink:
    """One end of a daemon's socket to its holder."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def send(self, word: str, fds: list[int] | None = None, **fields) -> None:
        data = (json.dumps({"word": word, **fields}) + "\n").encode()
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)

    def receive(self) -> tuple[dict | None, list[int]]:
        """The next message and the descriptors that came with it; (None, []) at the end."""
        fds: list[int] = []
        while b"\n" not in self._buf:
            data, got, _flags, _addr = socket.recv_fds(self.sock, 65536, 4)
            fds.extend(got)
            if not data:
                return None, fds
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line), fds

    def wait_for(self, word: str, timeout: float | None = None) -> dict | None:
        """The first message that is ``word`` (others are passed over), or None at the end of
        the link or after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if deadline is not None and b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                    return None
            msg, fds = self.receive()
            for fd in fds:
                os.close(fd)
            if msg is None or msg.get("word") == word:
                return msg

    def fileno(self) -> int:
        return self.sock.fileno()


class Handover:
    """A daemon's side of its holder: the link, the session state and, for a daemon that takes
    a connection over, the connection's descriptor (``device``)."""

    def __init__(self, link: HolderLink, state: SessionState, device: int | None,
                 standby: bool) -> None:
        self.link = link
        self.state = state
        self.device = device
        self.standby = standby
        self.handing_over = False  # the holder asked this daemon to let the mount go
        self.ending = False  # the mount ends (a signal): the holder must not restart anything

    @classmethod
    def from_fds(cls, link_fd: int, state_fd: int | None, device: int | None, *,
                 standby: bool = False) -> Handover:
        sock = socket.socket(fileno=link_fd)
        sock.set_inheritable(False)
        if state_fd is None:
            raise ValueError("a daemon started by a holder needs its session state")
        return cls(HolderLink(sock), SessionState(state_fd), device, standby)

    @property
    def takeover(self) -> bool:
        return self.device is not None

    def wait_go(self) -> bool:
        """A standby daemon (loaded, nothing opened): say so, then wait until the holder says
        the old daemon is gone. False when the holder went away instead."""
        try:
            self.link.send(STANDBY)
            return self.link.wait_for(GO) is not None
        except OSError:  # the holder is gone (the mount ended while this one loaded)
            return False

    def armed(self, device: int, minor: int | None, mountpoint: str, init: bytes | None) -> None:
        """The first daemon's mount answers: the holder keeps the connection from now on."""
        if init is not None:
            self.state.record_init(init)
        self.state.started()
        self.link.send(ARMED, fds=[device, 2], minor=minor, mountpoint=mountpoint)

    def serving(self) -> None:
        """A takeover daemon serves the connection."""
        self.link.send(READY, pid=os.getpid())

    def bye(self) -> None:
        self.ending = True
        try:
            self.link.send(BYE)
        except OSError:
            pass  # the holder is gone already
