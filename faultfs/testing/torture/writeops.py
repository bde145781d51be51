"""The seeded write script of the crash-consistency case: the same ops for the writer (a worker
process that performs them through a mount) and for the verifier (which replays them on a
plain ``bytes`` model).

A script is a function of ``(seed, source size, chunk size)`` only, so the verifier knows every
op the writer did from how many it logged. Ops: a write through the whole-object view (it may
grow the view), a write through ``chunk_N`` (inside the source's chunks), a new user blob
created in the tag directory with its first bytes, and a write into an existing user blob.
Nothing shrinks, so every op's effect is fixed by the ops before it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

KiB = 1 << 10
MAX_WRITE = 16 * KiB  # one FUSE write request each (the kernel splits at 128 KiB or more)
GROWTH = 64 * KiB  # view writes may start this far past the current end


@dataclass(frozen=True)
class WriteOp:
    n: int
    kind: str  # "view", "chunk", "user_new", "user_write"
    off: int  # in the view, the chunk or the user blob
    data: bytes
    index: int = 0  # the chunk of a "chunk" op
    name: str = ""  # the user blob of a "user_*" op


def script(seed: int, source_size: int, chunk_size: int) -> Iterator[WriteOp]:
    """The ops, in order, without end (``source_size`` is a multiple of ``chunk_size``)."""
    rng = random.Random(f"writes:{seed}")
    chunks = source_size // chunk_size
    view_size = source_size
    users: dict[str, int] = {}
    n = 0
    while True:
        r = rng.random()
        if r < 0.45:
            off = rng.randrange(0, view_size + GROWTH)
            data = rng.randbytes(rng.randrange(1, MAX_WRITE))
            view_size = max(view_size, off + len(data))
            yield WriteOp(n, "view", off, data)
        elif r < 0.80:
            index = rng.randrange(chunks)
            off = rng.randrange(chunk_size)
            data = rng.randbytes(min(chunk_size - off, rng.randrange(1, MAX_WRITE)))
            yield WriteOp(n, "chunk", off, data, index=index)
        elif r < 0.90 or not users:
            name = f"blob-{len(users):04d}.dat"
            data = rng.randbytes(rng.randrange(1, MAX_WRITE))
            users[name] = len(data)
            yield WriteOp(n, "user_new", 0, data, name=name)
        else:
            name = rng.choice(sorted(users))
            off = rng.randrange(0, users[name] + 4 * KiB)
            data = rng.randbytes(rng.randrange(1, MAX_WRITE))
            users[name] = max(users[name], off + len(data))
            yield WriteOp(n, "user_write", off, data, name=name)
        n += 1


def take(seed: int, source_size: int, chunk_size: int, count: int) -> list[WriteOp]:
    out = []
    for op in script(seed, source_size, chunk_size):
        if len(out) == count:
            break
        out.append(op)
    return out


@dataclass
class WriteModel:
    """What the tag must read after some ops: the view's bytes and each user blob's."""

    view: bytearray
    chunk_size: int
    users: dict[str, bytearray] = field(default_factory=dict)

    def copy(self) -> WriteModel:
        return WriteModel(bytearray(self.view), self.chunk_size,
                          {k: bytearray(v) for k, v in self.users.items()})

    def apply(self, op: WriteOp) -> None:
        if op.kind in ("view", "chunk"):
            off = op.off + (op.index * self.chunk_size if op.kind == "chunk" else 0)
            _put(self.view, off, op.data)
        elif op.kind == "user_new":
            self.users[op.name] = bytearray(op.data)
        else:
            _put(self.users[op.name], op.off, op.data)


def _put(buf: bytearray, off: int, data: bytes) -> None:
    end = off + len(data)
    if end > len(buf):
        buf.extend(bytes(end - len(buf)))
    buf[off:end] = data
