"""unlinked_open: writers that hold files open, unlink them, rename over them, chmod and touch
them and close them, in one tag at once, with a checkpoint every MiB (``--dirty-mb 1
--journal-mb 1``), so that unlinks, hides and last closes race with each other and with the
checkpoints (issue 43, items 1 and 14).

Each round: mount, run the writers, then either unmount or kill -9 the daemon; ``faultfs
fsck`` must call the store clean (exit 0) either way; a remount must show no hidden name and
keep a mode and times for every user blob and nothing more; the daemon's log must name no
failed checkpoint. One line per round and a verdict; exit 1 when anything failed.

Run through ``scripts/unlinked_open`` (the venv first); ``--quick`` is what the test runs.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import random
import sys
import time

from faultfs.testing.torture.harness import MiB, Run, TortureError

FILES = 12  # names the writers share: collisions are the point


def writer(tag: str, seed: int, seconds: float) -> int:
    """One writer's loop; the operations it made."""
    rng = random.Random(seed)
    held: list[int] = []
    end = time.monotonic() + seconds
    ops = 0
    while time.monotonic() < end:
        path = os.path.join(tag, f"f{rng.randrange(FILES)}")
        op = rng.random()
        try:
            if op < 0.3:
                with open(path, "ab") as f:
                    f.write(rng.randbytes(rng.randrange(1, 200_000)))
            elif op < 0.45:
                os.rename(path, os.path.join(tag, f"f{rng.randrange(FILES)}"))
            elif op < 0.6:
                os.unlink(path)
            elif op < 0.75:
                held.append(os.open(path, os.O_RDWR))
            elif op < 0.9 and held:
                fd = held.pop(rng.randrange(len(held)))
                os.pwrite(fd, b"y" * 5000, rng.randrange(300_000))
                if os.pread(fd, 5000, 0) is None or os.fstat(fd).st_size < 5000:
                    raise TortureError("an open file lost its bytes")
                os.close(fd)
            else:
                os.chmod(path, 0o600)
                os.utime(path, ns=(1, 2))
        except FileNotFoundError:
            pass  # another writer unlinked or renamed it first
        ops += 1
    for fd in held:
        os.close(fd)
    return ops


def states(store: str) -> list[dict]:
    out = []
    for path in glob.glob(os.path.join(store, "writes", "t-*", "state.json")):
        with open(path) as f:
            out.append(json.load(f))
    return out


def one_round(run: Run, src: str, n: int, *, kill: bool, writers: int, seconds: float) -> str:
    store = run.path(f"store-{n}")
    m = run.mount(src, store=store, args=["--chunk-size", "1M", "--dirty-mb", "1",
                                          "--journal-mb", "1"])
    tag = m.tag("s")
    pids = []
    for k in range(writers):
        pid = os.fork()
        if pid == 0:  # a writer of its own: closes, renames and unlinks race across processes
            code = 0
            try:
                writer(tag, n * 100 + k, seconds)
            except (ConnectionAbortedError, OSError) as exc:
                if exc.errno not in (errno.ENOTCONN, errno.ECONNABORTED) or not kill:
                    print(f"writer {k}: {exc!r}", file=sys.stderr)
                    code = 1
            except BaseException as exc:  # (reported through the exit code)
                print(f"writer {k}: {exc!r}", file=sys.stderr)
                code = 1
            os._exit(code)
        pids.append(pid)
    if kill:
        time.sleep(seconds / 2)
        m.kill9()
    bad = [pid for pid in pids if os.waitpid(pid, 0)[1] and not kill]
    if kill:
        m.close()
    else:
        m.umount()
    problems = [f"{len(bad)} writers failed"] if bad else []
    fsck = run.faultfs("fsck", store)
    if fsck.returncode != 0:
        problems.append(f"fsck exit {fsck.returncode}: {fsck.stdout.strip()[-300:]}")
    m2 = run.mount(src, store=store, args=["--chunk-size", "1M"])
    listed = os.listdir(m2.tag("s"))
    if any(name.startswith(".faultfs") for name in listed):
        problems.append(f"hidden names listed: {listed}")
    m2.umount()
    for doc in states(store):
        users = doc.get("users", {})
        hidden = [name for name in users if name.startswith(".faultfs")]
        if hidden:
            problems.append(f"hidden blobs kept after the remount: {hidden}")
        attrs = {int(uid) for uid in doc.get("user_attrs", {})}
        if attrs != set(users.values()):
            problems.append(f"modes and times of {sorted(attrs)} for ids {sorted(users.values())}")
    log = "".join(open(p).read() for p in glob.glob(os.path.join(store, "log", "*.log")))
    failed = [line for line in log.splitlines() if "checkpoint" in line and "fail" in line]
    if failed:
        problems.append(f"{len(failed)} failed checkpoints: {failed[0]}")
    return "; ".join(problems)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/unlinked_open",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two rounds of 3 s, two writers")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--writers", type=int, default=None)
    args = p.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 10)
    seconds = args.seconds or (3.0 if args.quick else 20.0)
    writers = args.writers or (2 if args.quick else 3)
    run = Run(quick=args.quick)
    failed = 0
    try:
        src, _ = run.make_source("s.bin", 4 * MiB, seed=1)
        for n in range(rounds):
            kill = n % 2 == 1
            try:
                problem = one_round(run, src, n, kill=kill, writers=writers, seconds=seconds)
            except TortureError as exc:
                problem = str(exc)
            failed += bool(problem)
            print(f"round {n} ({'kill -9' if kill else 'umount'}): {problem or 'ok'}",
                  flush=True)
    finally:
        left = run.cleanup()
        if left:
            print("cleanup: " + "; ".join(left))
    print(f"{rounds - failed} of {rounds} rounds held")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
