"""What the benchmarks share: the machine's caches, mounts and daemons, the rclone mount
they all compare with, and the S3 endpoint on loopback of the S3 benchmarks.

Imported by ``scripts/bench.py``, ``scripts/bench_s3`` and ``scripts/bench_shared.py`` (all run
with ``scripts/`` first on ``sys.path``). Everything here needs root where it touches the kernel (``drop_caches``,
FUSE connections).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
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


def unmount_and_reap(mnt: Path, dev: int | None, pid: int | None, unmount_cmd: list[str],
                     timeout: float = 60) -> None:
    """Unmount ``mnt`` with ``unmount_cmd`` (forced if that fails), then wait up to 30 s for
    its daemon ``pid`` to exit and kill it if it does not."""
    if is_mounted(mnt):
        try:
            run_cmd(unmount_cmd, timeout=timeout, check=False)
        except BenchError as exc:
            log(str(exc))
        if is_mounted(mnt):
            force_unmount(mnt, dev)
    if pid is not None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.05)
        kill_pid(pid)


def rclone_vfs_args(cache_dir: Path, writable: bool = False) -> list[str]:
    """How every benchmark mounts rclone: its full VFS cache (what users run for files they
    read more than once), the cache under the run's private directory; read-only unless
    ``writable`` (the write cases: rclone's defaults, a closed dirty file is uploaded back to
    the source directory after ``--vfs-write-back``, 5 s)."""
    args = ["--vfs-cache-mode", "full", "--cache-dir", str(cache_dir)]
    return args if writable else [*args, "--read-only"]


# --- processes, ports and undoing what a run started ---


class Cleanups:
    """What a run has to undo, run last-in first-out at exit; a step that fails is reported
    and the others still run. ``exit_on_signals`` makes Ctrl-C, SIGTERM and SIGHUP end the
    run through the caller's ``finally: cleanups.run()``."""

    def __init__(self, who: str = "bench") -> None:
        self.who = who
        self._steps: list[tuple[str, object]] = []

    def push(self, what: str, fn) -> None:
        self._steps.append((what, fn))

    def run(self) -> None:
        """Run every step; a second Ctrl-C (or SIGTERM) meanwhile does not cut it short."""
        held = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                held[sig] = signal.signal(sig, signal.SIG_IGN)
        try:
            while self._steps:
                what, fn = self._steps.pop()
                try:
                    fn()
                except Exception as exc:  # keep cleaning: one failure must not leave the rest
                    log(f"cleanup of {what} failed: {exc}", self.who)
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)


def exit_on_signals() -> None:
    """SIGINT, SIGTERM and SIGHUP raise SystemExit(128 + signal): ``finally`` blocks run."""

    def _raise(signum, frame):
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, _raise)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30) -> None:
    """Wait until ``proc`` (a server it started) accepts connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BenchError(f"{what} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise BenchError(f"{what} does not answer on port {port}")


def stop_process(proc: subprocess.Popen, grace_s: float = 10) -> None:
    """SIGTERM a child of ours, SIGKILL it after ``grace_s``, and reap it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- an S3 endpoint on loopback (s3rver or moto) and its fake credentials ---

S3_KEY_ID = S3_SECRET = "S3RVER"  # s3rver's built-in credentials (fake; every tool signs with them)
S3_REGION = "us-east-1"
S3RVER_VERSION = "3.7.1"


def s3rver_binary(cache: Path, who: str = "bench") -> Path | None:
    """s3rver from the npm registry into ``cache``, when node and npm are there (moto answers a
    ranged GET by reading the whole object: docs/benchmarks-s3.md)."""
    binary = cache / "node_modules" / ".bin" / "s3rver"
    if binary.exists():
        return binary
    if not (shutil.which("node") and shutil.which("npm")):
        log("node/npm are missing: cannot install s3rver", who)
        return None
    log(f"installing s3rver {S3RVER_VERSION} (npm) into {cache}", who)
    cache.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund",
                        "--loglevel=error", f"s3rver@{S3RVER_VERSION}"], capture_output=True,
                       text=True)
    if r.returncode != 0 or not binary.exists():
        log(f"npm install s3rver failed: {r.stderr.strip()[-300:]}", who)
        return None
    return binary


def start_s3_server(kind: str, work: Path, cache: Path, bucket: str,
                    who: str = "bench") -> tuple[str, str, subprocess.Popen]:
    """Start an S3 endpoint on 127.0.0.1 (``kind`` "s3rver", falling back to "moto" when it
    cannot be installed) with ``bucket``; (URL, description, process). The caller stops the
    process (``stop_process``); a server that does not come up is stopped here."""
    port = free_port()
    binary = s3rver_binary(cache, who) if kind == "s3rver" else None
    if kind == "s3rver" and binary is None:
        log("falling back to moto (slow for ranged reads: see docs/benchmarks-s3.md)", who)
        kind = "moto"
    if kind == "s3rver":
        data = work / "s3rver-data"
        data.mkdir()
        cmd = [str(binary), "-d", str(data), "-a", "127.0.0.1", "-p", str(port), "-s",
               "--configure-bucket", bucket, "--allow-mismatched-signatures"]
        # s3rver makes ListObjectsV2 continuation tokens with DES, which OpenSSL 3 keeps in
        # its legacy provider: without it every listing of more than 1000 keys fails (500)
        env = {**os.environ, "NODE_OPTIONS": "--openssl-legacy-provider"}
        version = subprocess.run(["node", "--version"], capture_output=True, text=True).stdout
        what = f"s3rver {S3RVER_VERSION} (node {version.strip()}), objects on local disk"
    else:
        from importlib.metadata import version as pkg_version

        cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
        env = None
        what = f"moto {pkg_version('moto')} server"
    with open(work / f"{kind}.log", "wb") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                start_new_session=True)
    try:
        wait_port(port, proc, kind)
    except BaseException:
        stop_process(proc)
        raise
    return f"http://127.0.0.1:{port}", what, proc


def s3_client(endpoint: str):
    """A boto3 client of the loopback endpoint with the fake credentials, path-style."""
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=endpoint, region_name=S3_REGION,
                        aws_access_key_id=S3_KEY_ID, aws_secret_access_key=S3_SECRET,
                        config=Config(s3={"addressing_style": "path"},
                                      retries={"max_attempts": 2}))


def ensure_bucket(client, bucket: str) -> None:
    try:
        client.create_bucket(Bucket=bucket)
    except client.exceptions.ClientError as exc:
        if "BucketAlreadyOwnedByYou" not in str(exc) and "BucketAlreadyExists" not in str(exc):
            raise


def aws_env(work: Path) -> dict:
    """The environment for tools that talk to the endpoint: the fake credentials only; the
    developer's own AWS files and variables are hidden."""
    (work / "aws-none").touch()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=S3_KEY_ID, AWS_SECRET_ACCESS_KEY=S3_SECRET,
               AWS_DEFAULT_REGION=S3_REGION, AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(work / "aws-none"),
               AWS_SHARED_CREDENTIALS_FILE=str(work / "aws-none"))
    return env


# --- reading ---


def timed_read(path: Path, size: int, block: int = 1 << 20) -> float:
    """Seconds for one sequential read of ``path`` (open included), ``block`` bytes per read;
    a short read is an error."""
    buf = bytearray(block)
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        total = 0
        while True:
            n = os.readv(fd, [buf])
            if not n:
                break
            total += n
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    if total != size:
        raise BenchError(f"read {total} bytes of {size} from {path}")
    return seconds


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (all its threads), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def methods_line(stats: dict) -> str:
    """A latency proxy's requests by method, with their count and time (its ``methods``)."""
    m = stats.get("methods") or {}
    if not m:
        return "none"
    return ", ".join(f"{k} {v[0]} ({v[2] * 1e3:.0f} ms)" for k, v in sorted(m.items())) + (
        "" if stats.get("log_complete", True) else " (log overflowed)")
