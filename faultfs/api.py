"""The Python API: mount from a notebook, a script or a test, without a shell.

    import faultfs, h5py
    with faultfs.mounted("s3://bucket/run42/field.h5", store="/scratch/cache") as root:
        with h5py.File(f"{root}/field/field.h5") as f:
            print(f["temperature"][0, :10])
        print(faultfs.stat(root)["faults"])

``mounted`` runs the same daemon as ``faultfs mount`` (a process of its own: FUSE never runs
inside the caller), waits until the mount answers, and unmounts when the block ends, also on
an exception. Options are the mount's flags with underscores: ``chunk_size="4M"``,
``read_only=True``, ``shared_store="s3://…"``.

Invariants: a failed mount raises ``MountError`` with the CLI's one-line message and leaves
no daemon and no mount behind; on exit no daemon of the mount is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from faultfs.core.names import CTL_NAME
from faultfs.errors import FaultfsError

MOUNT_TIMEOUT_S = 300.0


class MountError(FaultfsError):
    """``mounted`` could not mount: the message is the CLI's one line."""


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultfs.cli", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _flags(options: dict[str, Any]) -> list[str]:
    out = []
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            out.append(flag)
        elif isinstance(value, (list, tuple)):
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out


def _message(result: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    text = lines[-1] if lines else f"faultfs mount exited with {result.returncode}"
    return text.removeprefix("faultfs: ")


@contextlib.contextmanager
def mounted(*sources: str, mountpoint: str | os.PathLike[str] | None = None,
            store: str | os.PathLike[str] | None = None, **options: Any) -> Iterator[str]:
    """Mount ``sources`` (none: what ``store`` has registered) and yield the mountpoint."""
    made = None
    if mountpoint is None:
        made = tempfile.mkdtemp(prefix="faultfs-")
        mountpoint = made
    root = os.path.abspath(os.fspath(mountpoint))
    args = ["mount", *map(os.fspath, sources), root]
    if store is not None:
        args += ["--store", os.fspath(store)]
    try:
        result = _cli(*args, *_flags(options), timeout=MOUNT_TIMEOUT_S)
        if result.returncode != 0:
            raise MountError(_message(result))
        try:
            yield root
        finally:
            unmount(root)
    finally:
        if made is not None:
            with contextlib.suppress(OSError):
                os.rmdir(made)


def unmount(root: str) -> None:
    """Unmount ``root`` and make sure its daemon is gone (blocking)."""
    pid = None
    with contextlib.suppress(OSError, ValueError, KeyError):
        pid = int(_stats(root)["pid"])
    result = _cli("umount", root, timeout=120)
    if result.returncode != 0 and os.path.ismount(root):
        subprocess.run(["fusermount3", "-u", "-z", root], capture_output=True)
    if pid is not None:
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _stats(root: str | os.PathLike[str]) -> dict[str, Any]:
    with open(os.path.join(os.fspath(root), CTL_NAME, "stats"), "rb") as f:
        doc: dict[str, Any] = json.loads(f.read())
    return doc


def stat(root: str | os.PathLike[str]) -> dict[str, int]:
    """The counters of the mount at ``root`` (``faultfs stat``'s), as a dict."""
    try:
        return dict(_stats(root)["counters"])
    except (OSError, ValueError, KeyError) as exc:
        raise FaultfsError(f"{os.fspath(root)} is not a faultfs mount ({exc})") from None
