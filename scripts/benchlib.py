"""What the benchmarks share: the machine's caches, mounts and daemons, and the rclone mount
they all compare with.

Imported by ``scripts/bench.py`` and ``scripts/bench_s3`` (both run with ``scripts/`` first on
``sys.path``). Everything here needs root where it touches the kernel (``drop_caches``,
FUSE connections).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path


class BenchError(Exception):
    pass


def log(msg: str, who: str = "bench") -> None:
    print(f"[{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def drop_caches() -> None:
    """Write back, then drop the page cache, dentries and inodes (cold reads come off the disk)."""
    subprocess.run(["sync"], check=False, timeout=300)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_cmd(cmd: list[str], timeout: float = 120, check: bool = True,
            log_to: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``cmd``; with ``log_to``, its output goes to that file (for commands that leave a
    daemon holding their stdout, which would never reach EOF)."""
    try:
        if log_to is None:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        else:
            with open(log_to, "ab") as out:
                proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                      timeout=timeout)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{shlex.join(cmd)} did not finish in {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        detail = (proc.stderr or proc.stdout or "").strip()[-400:] if log_to is None else f"see {log_to}"
        raise BenchError(f"{shlex.join(cmd)} failed ({proc.returncode}): {detail}")
    return proc


def vm_hwm_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child of ours is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_mentioning(needle: str) -> list[int]:
    """Processes whose command line names ``needle`` (a path under our private temp dir)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if any(needle.encode() in a for a in argv):
            found.append(int(entry))
    return found


def kill_pid(pid: int, grace_s: float = 10) -> None:
    if not pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.1)
    if pid_alive(pid):
        log(f"killing pid {pid} (still alive {grace_s:.0f} s after SIGTERM)")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def bdi_readahead_path(mnt: Path) -> Path:
    dev = os.stat(mnt).st_dev
    return Path(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb")


def get_readahead_kb(mnt: Path) -> int | None:
    """The kernel's readahead window for the mount (what bounds FUSE's sequential requests)."""
    try:
        return int(bdi_readahead_path(mnt).read_text())
    except (OSError, ValueError):
        return None


def set_readahead_kb(mnt: Path, kb: int) -> None:
    with contextlib.suppress(OSError):
        bdi_readahead_path(mnt).write_text(str(kb))


def is_mounted(path: Path) -> bool:
    want = str(path)
    with open("/proc/self/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1 and fields[1].replace("\\040", " ") == want:
                return True
    return False


def force_unmount(mnt: Path, dev: int | None) -> None:
    """Last resort for a mount whose daemon hangs: abort the FUSE connection, detach lazily."""
    if dev is not None:
        abort = Path(f"/sys/fs/fuse/connections/{os.minor(dev)}/abort")
        with contextlib.suppress(OSError):
            abort.write_text("1")
    for cmd in (["fusermount3", "-u", "-z", str(mnt)], ["umount", "-l", str(mnt)]):
        if not is_mounted(mnt):
            return
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(cmd, capture_output=True, timeout=30)


def unmount(mnt: Path, dev: int | None = None) -> None:
    """Unmount a FUSE mount (also a dead one), the polite way first."""
    if is_mounted(mnt):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=60)
    if is_mounted(mnt):
        force_unmount(mnt, dev)


def rclone_vfs_args(cache_dir: Path) -> list[str]:
    """How every benchmark mounts rclone: its full VFS cache (what users run for files they
    read more than once), read-only, the cache under the run's private directory."""
    return ["--vfs-cache-mode", "full", "--cache-dir", str(cache_dir), "--read-only"]
