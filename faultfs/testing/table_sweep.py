"""The crash sweep of a tag's table changes: resets (of blobs and of the whole tag), user blob
creates, renames (over another blob), exchanges and unlinks, between writes, fsyncs and a
checkpoint — each crashed at every write and fsync point of the journal and dirty files in
turn (``SimOps(crash_at=n)``), then remounted as after a kill -9 and as after a power loss.

What must hold (DESIGN §11, §12): the tag comes back *whole* at one step of the script —
its view, its size and every user blob (names and bytes) exactly as they were after some
step, never a mix of two (a reset half made, a rename that lost both names, an exchange
that swapped one). After a kill that step is the one crashed in or the one before it; after
a power loss it is any step from the last durable one (an fsync, or a table change: they
are answered once synced) on. A per-blob model (``writes_model.py``) cannot see a mix
across blobs; this one compares the whole tag.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from faultfs.testing.crashfs import SimulatedCrash
from faultfs.testing.fakes import CS
from faultfs.testing.writes_model import WritesWorld

Shown = tuple[bytes, int, tuple[tuple[str, bytes], ...]]
Step = tuple[Callable[[WritesWorld], object], bool]  # (the step, durable once answered)


def shown(world: WritesWorld) -> Shown:
    """What the world's tag shows: its view's bytes and size, its user blobs' names and
    bytes (the mtime aside: a kill may keep an older one, by design)."""
    eng, tag = world.engine, world.tag

    async def look() -> Shown:
        size = eng.view_size(tag)
        users = []
        for name in sorted(eng.user_names(tag)):
            users.append((name, bytes(await eng.read_user(tag, name, 0, 1 << 22))))
        return bytes(await eng.read_view(tag, 0, size)), size, tuple(users)

    return world.run(look)


def _steps() -> list[Step]:
    def e(world: WritesWorld):
        return world.engine

    def call(name: str, *args, durable: bool = False) -> Step:
        return (lambda w: w.run(getattr(e(w), name), w.tag, *args)), durable

    return [
        call("write_view", 10, b"a" * 100),
        call("create_user", "a", durable=True),
        call("write_user", "a", 5, b"A" * 300),
        call("create_user", "b", durable=True),
        call("write_user", "b", 0, b"B" * 40),
        call("write_chunk", 1, 0, b"w" * CS),  # a whole chunk: a direct file
        ((lambda w: w.run(e(w).fsync)), True),
        call("rename_user", "a", "b", durable=True),  # over b: the old b's bytes go
        call("write_chunk", 1, 7, b"over"),
        call("reset", ["chunk_1", "b"], durable=True),  # blobs: a whole chunk, a user blob
        call("create_user", "c", durable=True),
        call("write_user", "c", 2, b"C" * 50),
        call("write_user", "b", 1, b"b"),
        call("exchange_users", "b", "c", durable=True),
        call("unlink_user", "c", durable=True),
        call("write_view", 3 * CS, b"g" * 200),  # grows the view
        ((lambda w: w.run(e(w).writes.checkpoint)), True),
        call("write_chunk", 0, 3, b"after the fold"),
        call("create_user", "d", durable=True),
        call("write_user", "d", 0, b"D" * 10),
        call("reset", durable=True),  # the whole tag
        call("write_chunk", 0, 1, b"x"),
        call("create_user", "b", durable=True),  # a name used before, a new blob
        call("write_user", "b", 0, b"new b"),
        call("rename_user", "b", "e", durable=True),
        ((lambda w: w.run(e(w).close_writes)), True),
    ]


def _world() -> WritesWorld:
    return WritesWorld(3 * CS + 500, CS)


def table_crash_sweep(seeds: int = 2) -> int:
    """Crash the script at each point in turn, stop as a kill and (``seeds`` reboots) as a
    power loss, and check the tag comes back whole at an allowed step. The points covered."""
    steps = _steps()
    probe = _world()
    try:
        seen = [shown(probe)]
        for step, _ in steps:
            step(probe)
            seen.append(shown(probe))
        total = probe.ops.points
    finally:
        probe.close()
    for crash_at in range(total + 1):
        for stop in ["kill", *[f"power{k}" for k in range(seeds)]]:
            world = _world()
            try:
                world.ops.crash_at = crash_at
                durable = at = 0  # the last durable step; the step crashed in
                for at, (step, sync) in enumerate(steps, 1):
                    try:
                        step(world)
                    except SimulatedCrash:
                        break
                    if world.ops.crashed:  # crashed below a step that went on (a fold)
                        break
                    if sync:
                        durable = at
                else:
                    at = len(steps)
                if stop == "kill":
                    world.remount("kill", check=False)
                    allowed = range(at - 1, at + 1)
                else:
                    world.remount("power", random.Random(crash_at * 100 + int(stop[5:])),
                                  check=False)
                    allowed = range(durable, at + 1)
                got = shown(world)
                match = [k for k in allowed if seen[k] == got]
                assert match, (f"crash at point {crash_at} (in step {at}), {stop}: the tag is "
                               f"no whole step from {allowed.start} to {allowed.stop - 1}: "
                               f"{_differ(got, [seen[k] for k in allowed])}")
                world.run(world.engine.write_view, world.tag, 1, b"after")  # it takes writes
                world.remount("clean", check=False)
            finally:
                world.close()
    return total


def _differ(got: Shown, candidates: list[Shown]) -> str:
    last = candidates[-1]
    if got[2] != last[2]:
        return f"user blobs {[n for n, _ in got[2]]} vs {[n for n, _ in last[2]]} (last)"
    if got[1] != last[1]:
        return f"view size {got[1]} vs {last[1]} (last)"
    return "the view's bytes differ"
