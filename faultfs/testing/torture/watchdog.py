"""A hang turned into a failure with its evidence, and the mount freed: the kernel stacks of
the stuck processes and of every thread of the daemon, the daemon's Python stacks (py-spy,
when installed: the daemon registers no faulthandler signal), then the FUSE connection aborted
through fusectl, the processes killed and reaped, the mount detached.

Invariants: nothing here touches the mount's files, and every wait has a timeout, so the
evidence is gathered and the mount freed whatever state the kernel and the daemon are in.
A Python stack is taken with ``py-spy dump --nonblocking``: py-spy's default stops the
process, and a process with a thread in uninterruptible sleep never stops.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from faultfs.testing.torture.harness import (
    Mount,
    Run,
    abort_fuse,
    alive,
    ensure_fusectl,
    kill_and_reap,
    mounts_at,
    proc_state,
)

PY_SPY_TIMEOUT_S = 30.0
# where a thread waits when it has nothing to do (left out of the summary, kept in the notes)
IDLE_WAITS = frozenset({"do_epoll_wait", "ep_poll", "fuse_dev_do_read", "futex_do_wait",
                        "futex_wait_queue", "futex_wait_queue_me", "do_select", "do_sys_poll",
                        "hrtimer_nanosleep", "do_nanosleep", "io_cqring_wait", "0", "",
                        "pipe_read", "unix_stream_read_generic", "inet_csk_accept",
                        "do_wait", "unix_stream_data_wait"})


class Hang(Exception):
    """A step of a case made no progress within its bound: ``stuck`` names the processes
    (label -> pid) waiting, with what each was doing."""

    def __init__(self, what: str, stuck: dict[str, tuple[int, str]]) -> None:
        super().__init__(what)
        self.what = what
        self.stuck = stuck


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError as exc:
        return f"<{exc.strerror}>"


def _frames(stack: str) -> list[str]:
    """``[<0>] folio_wait_bit+0x120/0x250`` lines as function names."""
    out = []
    for line in stack.splitlines():
        m = re.search(r"\]\s*([\w.]+)", line)
        if m:
            out.append(m.group(1))
    return out


@dataclass
class Thread:
    tid: int
    comm: str
    state: str
    wchan: str
    frames: list[str] = field(default_factory=list)

    def busy(self) -> bool:
        return self.state not in ("Z", "X") and self.wchan not in IDLE_WAITS and \
            not (self.frames and self.frames[0] in IDLE_WAITS)

    def line(self, depth: int = 6) -> str:
        where = " <- ".join(self.frames[:depth]) or self.wchan or "running"
        return f"thread {self.tid} {self.comm!r} ({self.state}) in {where}"


def threads_of(pid: int) -> list[Thread]:
    """Every thread of ``pid`` with its kernel stack (empty when it is gone)."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return []
    out = []
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        stat = _read(f"{base}/stat")
        state = stat.rsplit(")", 1)[1].split()[0] if ")" in stat else "?"
        out.append(Thread(tid, _read(f"{base}/comm").strip(), state,
                          _read(f"{base}/wchan").strip(), _frames(_read(f"{base}/stack"))))
    return out


def py_spy() -> str | None:
    """The py-spy command, when installed (on the PATH or beside this Python)."""
    found = shutil.which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else None


def python_stacks(pid: int) -> str:
    tool = py_spy()
    if tool is None:
        return ("no Python stacks: py-spy is not installed (pip install py-spy) and the daemon "
                "registers no faulthandler signal")
    try:
        result = subprocess.run([tool, "dump", "--pid", str(pid), "--nonblocking"],
                                capture_output=True, text=True, timeout=PY_SPY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"py-spy dump --pid {pid} did not return in {PY_SPY_TIMEOUT_S:.0f} s"
    return (result.stdout + result.stderr).strip() or f"py-spy said nothing (exit {result.returncode})"


@dataclass
class Evidence:
    """What a hang looked like: one summary line and the full stacks for the notes."""

    summary: str
    notes: list[str]


def gather(hang: Hang, daemon_pid: int | None) -> Evidence:
    """The kernel stacks of the stuck processes and of the daemon, and the daemon's Python
    stacks: before anything is killed or aborted."""
    notes = [f"hang: {hang.what}"]
    stuck_lines = []
    for label, (pid, doing) in hang.stuck.items():
        threads = threads_of(pid)
        state = proc_state(pid) or "gone"
        notes.append(f"{label} (pid {pid}, {state}), doing: {doing or '?'}")
        notes.extend("    " + t.line(depth=40) for t in threads)
        busy = [t for t in threads if t.busy()] or threads[:1]
        stuck_lines.append(f"{label} [{doing or '?'}]: " + "; ".join(t.line(4) for t in busy))
    daemon_lines = []
    if daemon_pid is not None and alive(daemon_pid):
        threads = threads_of(daemon_pid)
        notes.append(f"the daemon (pid {daemon_pid}): {len(threads)} threads")
        notes.extend("    " + t.line(depth=40) for t in threads)
        daemon_lines = [t.line(6) for t in threads if t.busy()]
        notes.append("the daemon's Python stacks:\n" + python_stacks(daemon_pid))
    elif daemon_pid is not None:
        notes.append(f"the daemon (pid {daemon_pid}) is gone ({proc_state(daemon_pid)})")
    summary = (f"hang: {hang.what}; stuck: " + " | ".join(stuck_lines[:4])
               + (f" (and {len(stuck_lines) - 4} more)" if len(stuck_lines) > 4 else "")
               + "; the daemon: " + (" | ".join(daemon_lines[:3]) or "no thread outside "
                                     "its idle waits"))
    return Evidence(summary, notes)


def free_mount(run: Run, m: Mount, pids: list[int]) -> list[str]:
    """Abort the mount's FUSE connection, kill ``pids`` and the daemon, detach the mount;
    what could not be done (empty when all went)."""
    problems = []
    if not ensure_fusectl():
        problems.append("fusectl could not be mounted: the connection was not aborted")
    abort_fuse(m.minor)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if m.pid is not None:
        if not kill_and_reap(m.pid):
            problems.append(f"the daemon {m.pid} outlived kill -9 and the abort")
        m.pid = None
    m.close()
    deadline = time.monotonic() + 30
    for pid in pids:
        while alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.05)
        if alive(pid):
            problems.append(f"process {pid} did not die ({proc_state(pid)})")
    if mounts_at(m.path):
        problems.append(f"{m.path} is still mounted")
    run.forget_mount(m)
    return problems
