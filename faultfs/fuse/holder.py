"""The holder: a small long-lived process that keeps a mount's FUSE connection and its session
state, and starts a daemon to serve it whenever the one serving it is gone (DESIGN §16).

``faultfs mount`` starts the holder; the holder starts the first daemon, which mounts, then
hands the connection's ``/dev/fuse`` descriptor (and its log) to the holder (``ARMED``). From
then on the connection lives as long as the holder does, whatever happens to daemons:
- a daemon that dies (kill -9, abort, an unhandled error) is replaced by a new one that takes
  the connection over (``--takeover-fd``): readers and writers wait, then go on;
- ``faultfs restart MNT`` asks the holder (its control socket) for a planned replacement: the
  new daemon loads first (``STANDBY``), the old one stops reading, finishes what it read, makes
  every write durable and exits (``HAND_OVER``), then the new one takes over (``GO``);
- restarts are bounded: more than ``RESTARTS_MAX`` crashes within ``RESTART_WINDOW_S`` and the
  holder gives up: it aborts the connection (readers get ENOTCONN, as when a daemon died before
  restarts existed) and says why in the log;
- the connection's end (an unmount, an abort) ends the holder; so does a daemon that says the
  mount is ending (``BYE``, after a signal), or one that dies before the mount ever answered.

The holder does no I/O on the mount and imports nothing of the engine: there is little for it
to crash on. Killed itself, it takes its copy of the descriptor with it: the daemon serving
goes on serving (its own copy), but its next crash ends the mount as before restarts existed.
A daemon that hangs is not the holder's to judge (a guess would kill slow but healthy daemons):
``faultfs umount`` recovers a silent mount, and the kernel's request timeout
(``/proc/sys/fs/fuse/default_request_timeout``, Linux >= 6.14) aborts one when set.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time

from faultfs.fuse.handover import (
    ARMED,
    BYE,
    GO,
    HAND_OVER,
    READY,
    STANDBY,
    HolderLink,
    SessionState,
)

log = logging.getLogger("faultfs.holder")

RESTARTS_MAX = 5  # crashes within RESTART_WINDOW_S the holder restarts a daemon after
RESTART_WINDOW_S = 60.0  # (FAULTFS_RESTARTS_MAX and FAULTFS_RESTART_WINDOW_S override them)
STANDBY_WAIT_S = 120.0  # a replacement daemon has this long to load (imports, config)
HANDOVER_WAIT_S = 120.0  # the old daemon has this long to finish, fold and exit (then: kill)
READY_WAIT_S = 300.0  # a replacement has this long to recover the store and serve
TICK_S = 1.0  # how often the holder looks whether the connection still lives
# A standby daemon is started (loaded: imports, arguments) once a daemon serves, so that a
# crash costs only the store's recovery, not a Python start (FAULTFS_STANDBY=0: none)


def control_path(run_dir: str, minor: int) -> str:
    return os.path.join(run_dir, f"holder-{minor}.sock")


class Daemon:
    """One daemon process the holder started, and its link."""

    def __init__(self, proc: subprocess.Popen, link: HolderLink) -> None:
        self.proc = proc
        self.link = link
        self.started = time.time()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        """Its exit status once it is gone, else None. A daemon whose main thread exited is
        gone even when a thread of it still waits in the kernel (a request it made to its own
        mount cannot be abandoned, and keeps it from being reaped until a new daemon answers
        it): that one counts as killed (-9)."""
        code = self.proc.poll()
        if code is not None:
            return code
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None
        return -signal.SIGKILL if state == b"Z" else None

    def wait_word(self, want: str, timeout: float) -> dict | None:
        """The next message that is ``want``, when it comes within ``timeout`` s."""
        return self.link.wait_for(want, timeout)


class Holder:
    def __init__(self, command: list[str], argv: list[str], run_dir: str | None) -> None:
        self.command = command  # how a daemon is run: its arguments travel on its stdin
        self.argv = argv
        self.run_dir = run_dir
        self.state = SessionState.create()
        self.device: int | None = None
        self.minor: int | None = None
        self.mountpoint = ""
        self.daemon: Daemon | None = None
        self.standby: Daemon | None = None  # loaded, waiting for GO (a crash's replacement)
        self.want_standby = os.environ.get("FAULTFS_STANDBY", "1") not in ("0", "no", "off")
        self.control: socket.socket | None = None
        self._control_id: tuple[int, int] | None = None  # (st_dev, st_ino) of its socket file
        self.crashes: collections.deque[float] = collections.deque()
        self.dying: list[Daemon] = []  # gone, not yet reaped (see Daemon.exit_code)
        self.ending = False
        self.restarts_max = int(os.environ.get("FAULTFS_RESTARTS_MAX", RESTARTS_MAX))
        self.window_s = float(os.environ.get("FAULTFS_RESTART_WINDOW_S", RESTART_WINDOW_S))

    # -- daemons --------------------------------------------------------------------------------

    def spawn(self, *, takeover: bool, standby: bool = False, ready_fd: int | None = None
              ) -> Daemon:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        extra = ["--holder-fd", str(theirs.fileno()), "--state-fd", str(self.state.fd)]
        fds = [theirs.fileno(), self.state.fd]
        if takeover:
            assert self.device is not None
            extra += ["--takeover-fd", str(self.device)]
            fds.append(self.device)
        if standby:
            extra.append("--standby")
        if ready_fd is not None:
            extra += ["--ready-fd", str(ready_fd)]
            fds.append(ready_fd)
        proc = subprocess.Popen(self.command, pass_fds=fds, stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)
        theirs.close()
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write(json.dumps([*self.argv, *extra]).encode())
            proc.stdin.close()
        return Daemon(proc, HolderLink(ours))

    def arm(self, msg: dict, fds: list[int]) -> None:
        """The first daemon's mount answers: keep its connection (and log to its log)."""
        if len(fds) < 1:
            log.error("the daemon armed the holder without a descriptor")
            return
        self.device = fds[0]
        for fd in fds[1:]:
            os.dup2(fd, 2)  # the store's log
            os.close(fd)
        self.minor = int(msg["minor"])
        self.mountpoint = str(msg["mountpoint"])
        self.open_control()
        log.info("holding the FUSE connection %d of %s (holder pid %d)", self.minor,
                 self.mountpoint, os.getpid())

    def open_control(self) -> None:
        if self.run_dir is None or self.minor is None:
            return
        path = control_path(self.run_dir, self.minor)
        try:
            os.makedirs(self.run_dir, mode=0o700, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(4)
            st = os.stat(path)
            self._control_id = (st.st_dev, st.st_ino)  # ours, to unlink at the end
        except OSError as exc:
            log.warning("no control socket at %s (%s): `faultfs restart` cannot reach this "
                        "mount", path, exc.strerror)
            return
        self.control = sock

    def connection_ended(self) -> bool:
        if self.device is None:
            return False
        p = select.poll()
        p.register(self.device, 0)
        return any(ev & (select.POLLERR | select.POLLHUP | select.POLLNVAL)
                   for _fd, ev in p.poll(0))

    # -- the loop -------------------------------------------------------------------------------

    def run(self, ready_fd: int | None) -> int:
        self.daemon = self.spawn(takeover=False, ready_fd=ready_fd)
        if ready_fd is not None:
            os.close(ready_fd)
        while True:
            daemon = self.daemon
            watch: list = [daemon.link] if daemon else []
            if self.standby is not None:
                watch.append(self.standby.link)
            if self.control is not None:
                watch.append(self.control)
            readable = select.select(watch, [], [], TICK_S)[0] if watch else []
            for source in readable:
                if source is self.control:
                    self.serve_control()
                elif daemon is not None and source is daemon.link:
                    self.hear(daemon)
                elif self.standby is not None and source is self.standby.link:
                    self.hear_standby()
            if self.connection_ended():
                log.info("the FUSE connection of %s ended: the holder exits", self.mountpoint)
                self.finish()
                return 0
            self.dying = [d for d in self.dying if d.proc.poll() is None]
            daemon = self.daemon
            code = daemon.exit_code() if daemon is not None else None
            if daemon is not None and code is not None:
                if daemon.proc.returncode is None:
                    self.dying.append(daemon)
                self.daemon = None
                if self.device is None:
                    return code  # it never mounted (the mount command said why) or failed early
                if self.ending:
                    self.finish()
                    return 0
                self.crashed(daemon, code)
                if self.daemon is None:
                    return 1

    def hear(self, daemon: Daemon) -> None:
        try:
            msg, fds = daemon.link.receive()
        except (OSError, ValueError):
            msg, fds = None, []
        if msg is None:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.proc.wait(TICK_S)  # the daemon is going: its exit is handled next
            return
        word = msg.get("word")
        if word == ARMED:
            self.arm(msg, fds)
            self.prepare_standby()
        else:
            for fd in fds:
                os.close(fd)
            if word == BYE:
                self.ending = True
            elif word == READY:
                log.info("daemon %d serves %s", daemon.pid, self.mountpoint)
                self.prepare_standby()

    def crashed(self, daemon: Daemon, code: int) -> None:
        how = (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}")
        if not self.state.resend:
            log.error("the daemon %d of %s %s; this kernel cannot resend what it had read "
                      "(FUSE_NOTIFY_RESEND, Linux >= 6.9): the mount ends", daemon.pid,
                      self.mountpoint, how)
            self.give_up()
            return
        now = time.monotonic()
        self.crashes.append(now)
        while self.crashes and now - self.crashes[0] > self.window_s:
            self.crashes.popleft()
        if len(self.crashes) > self.restarts_max:
            log.error("the daemon of %s %s, its %d%s crash within %.0f s: not restarting it "
                      "again; aborting the connection (readers get ENOTCONN)", self.mountpoint,
                      how, len(self.crashes), _nth(len(self.crashes)), self.window_s)
            self.give_up()
            return
        log.warning("the daemon %d of %s %s: %s to take the mount over", daemon.pid,
                    self.mountpoint, how,
                    f"letting the standby daemon {self.standby.pid} in" if self.standby
                    else "starting a new daemon")
        self.daemon = self.replacement()
        try:
            self.daemon.link.send(GO)
        except OSError:
            pass  # it died meanwhile: the loop sees its exit

    def prepare_standby(self) -> None:
        """Start loading the daemon that replaces the serving one when it goes."""
        if self.want_standby and self.standby is None and self.device is not None:
            self.standby = self.spawn(takeover=True, standby=True)

    def replacement(self) -> Daemon:
        """The standby daemon (started now when there is none)."""
        new, self.standby = self.standby, None
        if new is None or new.proc.poll() is not None:
            new = self.spawn(takeover=True, standby=True)
        return new

    def hear_standby(self) -> None:
        standby = self.standby
        assert standby is not None
        try:
            msg, fds = standby.link.receive()
        except (OSError, ValueError):
            msg, fds = None, []
        for fd in fds:
            os.close(fd)
        if msg is None:  # it died before it was needed: the next crash starts one afresh
            log.warning("the standby daemon %d of %s exited (%s)", standby.pid, self.mountpoint,
                        standby.proc.wait())
            self.standby = None

    def give_up(self) -> None:
        """End the connection: nothing waits on a mount nobody will serve."""
        if self.minor is not None:
            with contextlib.suppress(OSError):
                with open(f"/sys/fs/fuse/connections/{self.minor}/abort", "w") as f:
                    f.write("1")
        self.finish()

    def finish(self) -> None:
        if self.standby is not None:  # it exits when its link ends
            self.standby.link.sock.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.standby.proc.wait(10)
            self.standby = None
        if self.device is not None:
            os.close(self.device)
            self.device = None
        if self.control is not None and self.run_dir is not None and self.minor is not None:
            # only if the path is still our socket: the connection's number is reused, and a
            # mount made meanwhile may have bound its own holder's socket there (removing it
            # left that mount's `faultfs restart` with "no holder", seen in a suite run)
            path = control_path(self.run_dir, self.minor)
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == self._control_id:
                    os.unlink(path)
            self.control.close()
            self.control = None

    # -- the control socket -----------------------------------------------------------------------

    def serve_control(self) -> None:
        assert self.control is not None
        try:
            conn, _ = self.control.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(5.0)
            try:
                line = conn.makefile("rb").readline()
                request = json.loads(line or b"{}")
            except (OSError, ValueError):
                return
            if request.get("cmd") == "restart":
                answer = self.restart()
            elif request.get("cmd") == "status":
                answer = {"ok": True, "holder_pid": os.getpid(),
                          "daemon_pid": self.daemon.pid if self.daemon else None,
                          **self.state.describe()}
            else:
                answer = {"ok": False, "error": f"unknown request {request.get('cmd')!r}"}
            with contextlib.suppress(OSError):
                conn.settimeout(5.0)
                conn.sendall((json.dumps(answer) + "\n").encode())

    def restart(self) -> dict:
        """Replace the serving daemon by one running the installed code, with no request
        failing: load the new one, let the old one finish and go, then let the new one in."""
        old = self.daemon
        if old is None or self.device is None:
            return {"ok": False, "error": "no daemon serves this mount right now"}
        t0 = time.monotonic()
        # not the standby: it runs the code installed when it started; an upgrade wants the
        # code installed now (the standby is replaced too, below)
        new = self.spawn(takeover=True, standby=True)
        if new.wait_word(STANDBY, STANDBY_WAIT_S) is None:
            _end(new.proc)
            return {"ok": False, "error": "the new daemon did not start (see the store's log)"}
        t_loaded = time.monotonic()
        with contextlib.suppress(OSError):
            old.link.send(HAND_OVER)
        try:
            old.proc.wait(HANDOVER_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning("daemon %d did not hand %s over within %.0f s: killing it (the kernel "
                        "resends what it read)", old.pid, self.mountpoint, HANDOVER_WAIT_S)
            old.proc.kill()
            old.proc.wait()
        t_gone = time.monotonic()
        self.daemon = new
        new.link.send(GO)
        if new.wait_word(READY, READY_WAIT_S) is None:
            return {"ok": False, "error": "the new daemon did not take the mount over (see the "
                                          "store's log); the holder restarts it"}
        t_ready = time.monotonic()
        if self.standby is not None:  # loaded with the old code: load the new
            old_standby, self.standby = self.standby, None
            old_standby.link.sock.close()
            old_standby.proc.wait()
        self.prepare_standby()
        log.info("restarted the daemon of %s: pid %d -> %d (loaded in %.2f s; the mount "
                 "waited %.2f s)", self.mountpoint, old.pid, new.pid, t_loaded - t0,
                 t_ready - t_loaded)
        return {"ok": True, "old_pid": old.pid, "pid": new.pid,
                "waited_s": round(t_ready - t_loaded, 3), "handover_s": round(t_gone - t_loaded, 3)}


def _end(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def _nth(n: int) -> str:
    return {1: "st", 2: "nd", 3: "rd"}.get(n if n < 20 else n % 10, "th")


def ask(run_dir: str, minor: int, cmd: str, timeout: float) -> dict:
    """Send ``cmd`` to the holder of connection ``minor`` and return its answer."""
    path = control_path(run_dir, minor)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise OSError(errno.ENOENT, "no holder keeps this mount") from None
        sock.sendall((json.dumps({"cmd": cmd}) + "\n").encode())
        line = sock.makefile("rb").readline()
    return json.loads(line or b'{"ok": false, "error": "the holder did not answer"}')


def main() -> int:
    """``python -m faultfs.fuse.holder``: its request (JSON) on stdin."""
    request = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)  # fd 0 stays taken
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    holder = Holder(request["command"], request["argv"], request.get("run_dir"))

    def forward(signum: int, _frame) -> None:
        """A signal to the holder is one to its daemon: SIGTERM unmounts, as it always did."""
        if holder.daemon is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(holder.daemon.pid, signum)

    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, forward)
    return holder.run(request.get("ready_fd"))


if __name__ == "__main__":
    sys.exit(main())
