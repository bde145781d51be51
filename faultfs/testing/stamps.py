"""Stamping writers, and the check of a snapshot of a tag against their logs (DESIGN §12: a
clone is its tag at one instant).

A writer makes its writes one after another, each a *stamp* naming its sequence number, and
logs when each started and when it was answered (``CLOCK_MONOTONIC``, which every process of
the machine shares). Two kinds:

- ``chunks``: write ``seq`` (1, 2, …) stamps ``chunk_{(seq - 1) % n}`` at offset 0, through
  that chunk's name; a later stamp of a chunk covers its earlier ones.
- ``user``: write ``seq`` stamps a user blob at ``(seq - 1) * RECORD``, appending.

What a snapshot holds of a writer is read from its bytes: a prefix of its writes (``Seen``),
or, when its bytes are no state the writer ever left, why not. ``check`` then asks the rule of
a point-in-time copy of several writers: every write answered before the snapshot began is in
it, and no write is in it while a write answered before that one started is not.

``python -m faultfs.testing.stamps chunks TAG_DIR N SECONDS LOG`` and ``… user PATH SECONDS
LOG`` run a writer (the log is written when it ends).
"""

from __future__ import annotations

import os
import struct
import sys
import time
from dataclasses import dataclass

MAGIC = b"STMP"
STAMP = struct.Struct("<4sQ4x")  # MAGIC, seq, padding: 16 bytes
RECORD = 4096  # a user writer's stamps lie this far apart: a few hundred cross a 1 MiB part
LOG = struct.Struct("<QQQ")  # seq, started_ns, answered_ns


def stamp(seq: int) -> bytes:
    return STAMP.pack(MAGIC, seq)


def stamp_seq(data: bytes) -> int:
    """The seq of the stamp ``data`` begins with; 0 when it holds none (the source's bytes)."""
    if len(data) < STAMP.size:
        return 0
    magic, seq = STAMP.unpack_from(data)
    return seq if magic == MAGIC else 0


@dataclass
class Log:
    """What a writer logged: for write ``seq`` (1-based), ``started[seq - 1]`` and
    ``answered[seq - 1]`` in ns."""

    started: list[int]
    answered: list[int]

    @classmethod
    def read(cls, path: str) -> Log:
        with open(path, "rb") as f:
            raw = f.read()
        rows = [LOG.unpack_from(raw, at) for at in range(0, len(raw), LOG.size)]
        assert [seq for seq, _, _ in rows] == list(range(1, len(rows) + 1)), "a log out of order"
        return cls([s for _, s, _ in rows], [a for _, _, a in rows])

    def answered_before(self, ns: int) -> int:
        """How many writes were answered before ``ns`` (they are answered in order)."""
        return sum(1 for a in self.answered if a < ns)


@dataclass
class Seen:
    """What a snapshot holds of one writer: its first ``prefix`` writes, or ``wrong``: why
    its bytes are no state the writer ever left."""

    prefix: int
    wrong: str = ""


def seen_chunks(stamps: list[int]) -> Seen:
    """A ``chunks`` writer's state from the seq stamped on each chunk (0: none)."""
    n, top = len(stamps), max(stamps, default=0)
    for i, got in enumerate(stamps):
        want = top - (top - 1 - i) % n if top > i else 0  # the last seq <= top of chunk i
        if got != want:
            return Seen(top, f"chunk_{i} holds write {got}, not {want}, beside write {top}")
    return Seen(top)


def seen_user(data: bytes) -> Seen:
    """A ``user`` writer's state from its blob's bytes."""
    count = len(data) // RECORD + (1 if len(data) % RECORD else 0)
    for k in range(count):
        got = stamp_seq(data[k * RECORD:(k + 1) * RECORD])
        if got != k + 1:
            return Seen(k, f"record {k} holds write {got}, not {k + 1}, in {len(data)} bytes")
    if len(data) % RECORD not in (0, STAMP.size):
        return Seen(count, f"{len(data)} bytes: no whole number of writes")
    return Seen(count)


def check(seen: dict[str, Seen], logs: dict[str, Log], began_ns: int) -> list[str]:
    """What a snapshot that began at ``began_ns`` breaks of the point-in-time rule, given
    what it holds of each writer and their logs; [] when nothing."""
    problems = [f"{w}: {s.wrong}" for w, s in seen.items() if s.wrong]
    if problems:
        return problems
    for w, s in seen.items():
        due = logs[w].answered_before(began_ns)
        if s.prefix < due:
            problems.append(f"{w}: holds {s.prefix} writes; {due} were answered before the "
                            "snapshot began")
        if s.prefix > len(logs[w].started):
            problems.append(f"{w}: holds {s.prefix} writes; {len(logs[w].started)} were made")
    for u, su in seen.items():  # u's first write it lacks ...
        lu = logs[u]
        if su.prefix >= len(lu.answered):
            continue
        missing_answered = lu.answered[su.prefix]
        for v, sv in seen.items():  # ... answered before v's last write it holds started
            if v != u and sv.prefix and missing_answered < logs[v].started[sv.prefix - 1]:
                problems.append(f"holds {v}'s write {sv.prefix} without {u}'s write "
                                f"{su.prefix + 1}, answered before it started")
    return problems


def _run(kind: str, args: list[str]) -> None:
    started: list[int] = []
    answered: list[int] = []
    if kind == "chunks":
        tag_dir, n, seconds, log = args[0], int(args[1]), float(args[2]), args[3]
        fds = [os.open(os.path.join(tag_dir, f"chunk_{i}"), os.O_RDWR) for i in range(n)]
        where = [(fds[i % n], 0) for i in range(n)]
    else:
        path, seconds, log = args[0], float(args[1]), args[2]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        where = []
    end = time.monotonic() + seconds
    seq = 0
    while time.monotonic() < end:
        seq += 1
        fd, off = where[(seq - 1) % len(where)] if where else (fd, (seq - 1) * RECORD)
        started.append(time.monotonic_ns())
        os.pwrite(fd, stamp(seq), off)
        answered.append(time.monotonic_ns())
    with open(log, "wb") as f:
        for k, (s, a) in enumerate(zip(started, answered, strict=True)):
            f.write(LOG.pack(k + 1, s, a))


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2:])
