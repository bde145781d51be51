"""Case 1: kill -9 of the daemon under 8 verifying readers, then a remount without cleanup.

Each trial mounts a fresh store (chunk size and prefetch vary by trial), starts 8 reader
processes that compare every byte they read with the source, kills the daemon with SIGKILL at
a seeded moment while faults are being staged, and remounts at the same mountpoint over the
dead mount (the CLI must detach it). Then every byte of the view and of every chunk file is
read back through the new mount and compared.

What must hold: no reader ever saw a wrong byte, before or at the kill (a read the kill cuts
short may return a prefix of the right bytes: counted, not wrong); every reader left the dead
mount (none stuck in the kernel); every remount succeeded and left exactly one mount at the
mountpoint; every byte read after the remount is the source's; no fault failed.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import time

from faultfs.testing.torture.harness import (
    Budget,
    CaseResult,
    MiB,
    Run,
    TortureError,
    diff_bytes,
    mounts_at,
    read_all,
    wait_json,
)

NAME = "kill -9 under readers"
READERS = 8
SOURCE_SIZE = 64 * MiB + 12345  # a short last chunk too (half of it in --quick)
READER_EXIT_S = 10.0  # a reader of a dead mount gets ENOTCONN at once; past this it is stuck


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    trials = 2 if run.quick else 20
    size = SOURCE_SIZE - (32 * MiB if run.quick else 0)
    src, data = run.make_source("kill9.bin", size, seed=run.seed + 1)
    rng = random.Random(f"kill9:{run.seed}")
    corrupt = stuck = failed_remounts = extra_mounts = early_errors = fault_errors = 0
    reads = torn_dropped = 0
    verified = temps = short = 0
    staged_at_kill: list[float] = []
    mnt = run.fresh_dir("kill9-mnt")
    for trial in range(trials):
        if budget.over():
            res.out_of_time(trial, trials, "trials")
            break
        cs = (256 << 10) if trial % 2 == 0 else MiB
        prefetch = "0" if trial % 3 == 0 else "32"
        store = run.path(f"kill9-store-{trial}")
        m = run.mount(src, store=store, mountpoint=mnt,
                      args=["--chunk-size", str(cs), "--prefetch-mb", prefetch])
        tag = m.tag("kill9")
        readers = [run.worker("reader", "--dir", tag, "--view", "kill9.bin", "--source", src,
                              "--chunk-size", str(cs), "--seed", str(trial * 100 + i),
                              "--stop-on-error") for i in range(READERS)]
        _wait_for_reads(m, READERS * 4)  # every reader under way (a loaded machine is slow)
        time.sleep(rng.uniform(0.05, 1.0))
        killed_at = time.monotonic()
        m.kill9()
        staged, in_flight = _staged(store, "kill9")
        staged_at_kill.append(staged / -(-len(data) // cs))
        temps += in_flight
        reports = []
        deadline = time.monotonic() + READER_EXIT_S
        for proc in readers:
            report = wait_json(proc, max(0.1, deadline - time.monotonic()))
            if report is None:  # did not meet the dead mount by itself: nudge, then judge
                proc.send_signal(signal.SIGTERM)
                report = wait_json(proc, 2.0)
                if report is None:
                    stuck += 1
                    proc.kill()
                    proc.wait()
                    continue
            reports.append(report)
        for report in reports:
            if "error" in report:
                raise TortureError(f"a reader failed: {report['error']}")
            reads += report["reads"]
            corrupt += report["corrupt_bytes"]
            if report["corrupt_bytes"]:
                res.notes.append(
                    f"trial {trial} (chunk size {cs}, prefetch {prefetch}): a reader read "
                    f"{report['corrupt_bytes']} wrong bytes in {report['corrupt_reads']} reads, "
                    f"first {report['first_corrupt']}, {report['corrupt_at'] - killed_at:+.3f} s "
                    f"from the kill (its next error {report['errors']})")
            short += report["short_reads"]
            at = report["first_error_at"]
            if at is not None and at < killed_at:
                early_errors += 1
                res.notes.append(f"trial {trial}: a reader failed before the kill: "
                                 f"{report['errors']}")
        try:
            m2 = run.mount(store=store, mountpoint=mnt)
        except TortureError as exc:
            failed_remounts += 1
            res.notes.append(f"trial {trial}: remount failed: {exc}")
            continue
        if mounts_at(mnt) != 1:
            extra_mounts += 1
        tag = m2.tag("kill9")
        bad = diff_bytes(read_all(os.path.join(tag, "kill9.bin")), data)
        if bad:
            res.notes.append(f"trial {trial}: after the remount the view has {bad} wrong bytes")
        for i in range(-(-len(data) // cs)):
            piece = data[i * cs:(i + 1) * cs]
            wrong = diff_bytes(read_all(os.path.join(tag, f"chunk_{i}")), piece.ljust(cs, b"\0"))
            if wrong:
                res.notes.append(f"trial {trial}: after the remount chunk_{i} has {wrong} wrong "
                                 "bytes")
            bad += wrong
        corrupt += bad
        verified += 2 * len(data)
        c = m2.counters()
        fault_errors += c["fault_errors"]
        torn_dropped += c["corrupt_blobs_dropped"]
        m2.umount()
        shutil.rmtree(store, ignore_errors=True)
        res.trials += 1
    res.operations = reads
    res.check(corrupt == 0, f"0 corrupt bytes ({reads:,} verified reads, {short} of them cut "
              f"short by the kill, each a prefix of the right bytes; {verified / MiB:,.0f} MiB "
              "verified after the remounts)",
              f"{corrupt} corrupt bytes")
    res.check(stuck == 0, "0 stuck mounts", f"{stuck} readers stuck on the dead mount")
    res.check(failed_remounts == 0 and extra_mounts == 0, "0 failed remounts",
              f"{failed_remounts} failed remounts, {extra_mounts} left a second mount")
    res.check(early_errors == 0 and fault_errors == 0, "no read failed before the kill",
              f"{early_errors} readers failed before the kill, {fault_errors} fault errors "
              "after remounts")
    res.notes.append(f"{short} short reads cut by the kills (a prefix of the right bytes)")
    res.notes.append(f"{torn_dropped} torn blobs found and dropped at remounts; "
                     f"{temps} blob writes in flight at the kills")
    if staged_at_kill:
        res.notes.append("staged at the kills: " + ", ".join(f"{f:.0%}" for f in staged_at_kill))


def _wait_for_reads(m, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if m.counters()["reads"] >= count:
            return
        time.sleep(0.02)
    raise TortureError(f"the readers did not get going in {timeout:.0f} s")


def _staged(store: str, tag: str) -> tuple[int, int]:
    """Blob files of ``tag`` in ``store``, and temporary files (writes cut by the kill)."""
    try:
        names = os.listdir(os.path.join(store, "tags", f"t-{tag}"))
    except FileNotFoundError:
        return 0, 0
    return (sum(n.startswith("b-") for n in names),
            sum(n.startswith("t-") and n.endswith(".tmp") for n in names))
