"""The cross-name case's layout and model, with no mount: which bytes each writer owns and
through which names those bytes are seen, the bytes of every write, and the checks of a tag's
bytes (a clone's, or the tag's at the end) against what the writers logged.

Invariants:
- Every byte of the tag is owned by at most one writer, so its expected value is that writer's
  alone, also where two writers' bytes share a kernel page (the shared units below).
- A write's bytes are a function of ``(writer id, seq)`` (``op_data``): the logs carry
  positions and times, never data.
- Two address spaces: ``v``, the view (``chunk_N`` and the first pages show it), and ``u``, the
  user blob (the pages past the view's show its head). A writer writes in one space.
- A writer is sequential: op ``k+1`` is issued after op ``k`` was answered. So at any instant
  the tag holds a prefix of each writer's ops, and a point-in-time copy holds, for every
  writer, the prefix of one instant between the copy's start and end (``Model.check_copy``).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
UNIT = 4 * KiB  # a kernel page: areas alternate units shared by the writers and units one owns

PARTS = ("view-chunk", "mmap-chunk", "page-chunk", "view-page", "user-page", "one-process",
         "truncate", "readers", "clones")
EXTRAS = ("readers", "clones")  # parts that are not writers


@dataclass(frozen=True)
class Layout:
    """The tag: a source of ``source_size`` bytes in ``chunk_size`` chunks, a user blob whose
    first ``user_mapped`` bytes the pagemap lays after the view's in page space, and ``tail``
    bytes past the source range and past the user blob's mapped head for the truncating
    writers."""

    source_size: int = 2 * MiB
    chunk_size: int = 64 * KiB
    page_size: int = 48 * KiB  # not a divisor of the chunk size: pages straddle chunks
    user_mapped: int = 256 * KiB
    tail: int = 128 * KiB
    view_name: str = "cross.bin"
    user_name: str = "ub.dat"

    @property
    def tag(self) -> str:
        return self.view_name.rsplit(".", 1)[0]

    @property
    def user_initial(self) -> int:
        return self.user_mapped + self.tail // 2

    def capacity(self, space: str) -> int:
        return (self.source_size if space == "v" else self.user_mapped) + self.tail

    def initial_size(self, space: str) -> int:
        return self.source_size if space == "v" else self.user_initial

    @property
    def num_chunks(self) -> int:
        return self.source_size // self.chunk_size

    @property
    def num_pages(self) -> int:
        return -(-(self.source_size + self.user_mapped) // self.page_size)

    def pagemap_text(self) -> str:
        """Identity extents of the chunks, then the user blob's head right after them."""
        cs = self.chunk_size
        lines = ["pagemap", f"page_size={self.page_size}",
                 f"total={self.source_size + self.user_mapped}"]
        lines += [f"chunk_{i} 0 {i * cs} {cs}" for i in range(self.num_chunks)]
        lines.append(f"{self.user_name} 0 {self.source_size} {self.user_mapped}")
        return "\n".join(lines) + "\n"

    def name_of(self, how: str, space: str, addr: int) -> tuple[str, int] | None:
        """The file and offset showing byte ``addr`` of ``space`` through a name of kind
        ``how`` (``view``, ``chunk``, ``page``, ``user``); None when that name shows no such
        byte."""
        if space == "v":
            if how == "view":
                return self.view_name, addr
            if how == "chunk":
                return f"chunk_{addr // self.chunk_size}", addr % self.chunk_size
            if how == "page" and addr < self.source_size:
                return f"page:{addr // self.page_size}", addr % self.page_size
            return None
        if how == "user":
            return self.user_name, addr
        if how == "page" and addr < self.user_mapped:
            x = self.source_size + addr
            return f"page:{x // self.page_size}", x % self.page_size
        return None

    def page_bytes(self, index: int, view: np.ndarray, user: np.ndarray) -> np.ndarray:
        """What ``page:index`` must read, given the view's and the user blob's bytes (each
        zero-padded to its capacity)."""
        lo, hi = index * self.page_size, (index + 1) * self.page_size
        out = np.zeros(self.page_size, dtype=np.uint8)
        s, k = self.source_size, self.user_mapped
        if lo < s:
            out[:min(hi, s) - lo] = view[lo:min(hi, s)]
        if hi > s and lo < s + k:
            a, b = max(lo, s), min(hi, s + k)
            out[a - lo:b - lo] = user[a - s:b - s]
        return out


@dataclass(frozen=True)
class WriterSpec:
    """One writer: what it writes through (``via``), in which space, which bytes it owns,
    and the names it reads each write back through (``checks``)."""

    wid: str  # "<part>/<via>": unique in a run
    part: str
    via: str  # view, chunk, page, user, mmap (a shared map of the view)
    space: str
    checks: tuple[str, ...]
    slots: tuple[tuple[int, int], ...] = ()  # owned pieces of shared units
    units: tuple[int, ...] = ()  # starts of units owned whole
    tail: tuple[int, int] | None = None  # a truncating writer's room (it owns it whole)

    @property
    def truncates(self) -> bool:
        return self.tail is not None

    def box(self) -> tuple[int, int]:
        """The smallest range holding every owned byte."""
        if self.tail is not None:
            return self.tail
        ends = [hi for _, hi in self.slots] + [u + UNIT for u in self.units]
        starts = [lo for lo, _ in self.slots] + list(self.units)
        return min(starts), max(ends)

    def owned(self) -> Iterable[tuple[int, int]]:
        if self.tail is not None:
            yield self.tail
        yield from self.slots
        for u in self.units:
            yield u, u + UNIT


def share(lo: int, hi: int, k: int) -> list[tuple[list[tuple[int, int]], list[int]]]:
    """Split ``[lo, hi)`` among ``k`` writers: even units in ``k`` pieces (one each, so they
    share the kernel page), odd units whole to one writer in turn. Per writer: (pieces,
    whole units)."""
    per: list[tuple[list[tuple[int, int]], list[int]]] = [([], []) for _ in range(k)]
    for n, start in enumerate(range(lo, hi, UNIT)):
        if n % 2 == 0:
            for j in range(k):
                per[j][0].append((start + j * UNIT // k, start + (j + 1) * UNIT // k))
        else:
            per[(n // 2) % k][1].append(start)
    return per


# part -> (space, first and last chunk of its area (in the user blob: bytes), its writers as
# (via, checks)). "holder": the shared map of the view another process holds.
_PAIRS: dict[str, tuple[str, tuple[int, int], tuple[tuple[str, tuple[str, ...]], ...]]] = {
    "view-chunk": ("v", (0, 8), (("view", ("chunk",)), ("chunk", ("view",)))),
    "mmap-chunk": ("v", (8, 12), (("mmap", ("chunk", "view")),
                                  ("chunk", ("view", "holder")))),
    "page-chunk": ("v", (12, 20), (("page", ("chunk",)), ("chunk", ("page",)))),
    "view-page": ("v", (20, 28), (("view", ("page",)), ("page", ("view",)))),
    # one process: a write into its map of the view, then (before the msync that answers
    # it) a write through chunk_N — numpy.memmap r+ and dd into a chunk in one program
    "one-process": ("v", (28, 30), (("mmap", ("chunk", "view")), ("chunk", ("map", "view")))),
}


def all_specs(layout: Layout) -> list[WriterSpec]:
    """Every writer of every part (chunks 30 and 31 are nobody's: they must keep the
    source's bytes)."""
    specs = []
    cs = layout.chunk_size
    for part, (space, (first, last), writers) in _PAIRS.items():
        pieces = share(first * cs, last * cs, len(writers))
        for (via, checks), (slots, units) in zip(writers, pieces, strict=True):
            specs.append(WriterSpec(f"{part}/{via}", part, via, space, checks, tuple(slots),
                                    tuple(units)))
    pieces = share(0, layout.user_mapped, 2)
    specs.append(WriterSpec("user-page/user", "user-page", "user", "u", ("page",),
                            tuple(pieces[0][0]), tuple(pieces[0][1])))
    specs.append(WriterSpec("user-page/page", "user-page", "page", "u", ("user",),
                            tuple(pieces[1][0]), tuple(pieces[1][1])))
    s, k, t = layout.source_size, layout.user_mapped, layout.tail
    specs.append(WriterSpec("truncate/view", "truncate", "view", "v", ("chunk",),
                            tail=(s, s + t)))
    specs.append(WriterSpec("truncate/user", "truncate", "user", "u", ("user-again",),
                            tail=(k, k + t)))
    return specs


def writer_specs(layout: Layout, chosen: Iterable[str]) -> list[WriterSpec]:
    """The writers ``chosen`` names (by part, or one writer by its id)."""
    picked = set(chosen)
    return [s for s in all_specs(layout) if s.wid in picked or s.part in picked]


def parse_parts(text: str | None) -> list[str]:
    """``--crossname-parts``: ``all`` (the default), a comma list of parts (``PARTS``) and
    single writers (``mmap-chunk/chunk``: that writer without its partner), ``-ITEM`` to
    leave one out (``all,-view-chunk``). The writers' ids, then ``readers`` and ``clones``
    if chosen."""
    every = [s.wid for s in all_specs(Layout())]

    def expand(item: str) -> list[str]:
        if item in EXTRAS:
            return [item]
        if item in PARTS:
            return [w for w in every if w.split("/")[0] == item]
        if item in every:
            return [item]
        raise ValueError(f"unknown crossname part {item!r} (parts: {', '.join(PARTS)}; "
                         f"writers: {', '.join(every)})")

    chosen: list[str] = []
    for item in (text or "all").split(","):
        item = item.strip()
        if not item:
            continue
        if item == "all":
            chosen += [w for w in [*every, *EXTRAS] if w not in chosen]
        elif item.startswith("-"):
            gone = expand(item[1:])
            chosen = [w for w in chosen if w not in gone]
        else:
            chosen += [w for w in expand(item) if w not in chosen]
    order = [*every, *EXTRAS]
    return sorted(chosen, key=order.index)


def op_data(wid: str, seq: int, n: int) -> bytes:
    return hashlib.shake_128(f"{wid}#{seq}".encode()).digest(n)


def user_initial_bytes(layout: Layout, seed: int) -> bytes:
    return op_data(f"user-initial-{seed}", 0, layout.user_initial)


@dataclass(frozen=True)
class Op:
    """One answered op of a writer's log: a write (``w``: ``addr``, ``n`` bytes) or a
    truncate (``t``: to ``addr`` bytes)."""

    seq: int
    t_issue: float
    t_answer: float
    kind: str
    space: str
    addr: int
    n: int

    def line(self, desc: str = "") -> str:
        """``I seq t_issue inf …  desc`` before the op, ``A seq t_issue t_answer …`` after."""
        head = "I" if math.isinf(self.t_answer) else "A"
        return (f"{head} {self.seq} {self.t_issue:.6f} {self.t_answer:.6f} {self.kind} "
                f"{self.space} {self.addr} {self.n}" + (f" {desc}" if desc else "") + "\n")

    @classmethod
    def parse(cls, line: str) -> tuple[Op, str] | None:
        """The op of an ``I`` or ``A`` line, and the description an ``I`` line carries."""
        f = line.split(" ", 8)
        if len(f) < 8 or f[0] not in ("I", "A"):
            return None
        op = cls(int(f[1]), float(f[2]), float(f[3]), f[4], f[5], int(f[6]), int(f[7]))
        return op, (f[8].strip() if len(f) > 8 else "")


@dataclass
class CopyVerdict:
    """What ``check_copy`` found: the prefix of each writer that matches (empty: none), and
    one line per problem."""

    prefixes: dict[str, list[int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class Model:
    """The tag's bytes as the writers' logs say, advanced writer by writer.

    ``state[space]`` holds each writer's bytes after its first ``base[wid]`` ops (a writer's
    bytes are its own, so the writers advance independently), zeros past ``size[space]``;
    ``last[space]`` says which op wrote each byte last (writer index, seq; -1: the initial
    bytes)."""

    def __init__(self, layout: Layout, specs: list[WriterSpec], view0: bytes, user0: bytes
                 ) -> None:
        self.layout = layout
        self.specs = specs
        self.index = {s.wid: i for i, s in enumerate(specs)}
        self.initial: dict[str, np.ndarray] = {}
        self.owner: dict[str, np.ndarray] = {}
        for space, data in (("v", view0), ("u", user0)):
            arr = np.zeros(layout.capacity(space), dtype=np.uint8)
            arr[:len(data)] = np.frombuffer(data, dtype=np.uint8)
            self.initial[space] = arr
            self.owner[space] = np.full(layout.capacity(space), -1, dtype=np.int32)
        for i, spec in enumerate(specs):
            for lo, hi in spec.owned():
                own = self.owner[spec.space][lo:hi]
                if (own != -1).any():
                    raise ValueError(f"{spec.wid} owns bytes another writer owns")
                own[:] = i
        self.state = {s: a.copy() for s, a in self.initial.items()}
        self.size = {s: layout.initial_size(s) for s in ("v", "u")}
        self.last = {s: np.full(layout.capacity(s), -1, dtype=np.int64) for s in ("v", "u")}
        self.ops: dict[str, list[Op]] = {s.wid: [] for s in specs}
        self.issued: dict[str, list[float]] = {s.wid: [] for s in specs}
        self.answered: dict[str, list[float]] = {s.wid: [] for s in specs}
        self.base = {s.wid: 0 for s in specs}

    # -- the logs ----------------------------------------------------------------------------

    def add(self, wid: str, op: Op) -> None:
        """An op from the log: issued (``t_answer`` infinite: it may or may not have taken
        effect yet) or answered (the op issued last, or a new one)."""
        ops = self.ops[wid]
        spec = self.specs[self.index[wid]]
        if op.space != spec.space:
            raise ValueError(f"{wid}: op {op.seq} in space {op.space}")
        if ops and ops[-1].seq == op.seq and math.isinf(ops[-1].t_answer):
            ops[-1] = op
            self.answered[wid][-1] = op.t_answer
            return
        if op.seq != len(ops) or (ops and math.isinf(ops[-1].t_answer)):
            raise ValueError(f"{wid}: op {op.seq} logged after {len(ops)} ops")
        ops.append(op)
        self.issued[wid].append(op.t_issue)
        self.answered[wid].append(op.t_answer)

    def answered_ops(self, wid: str) -> int:
        ops = self.ops[wid]
        return len(ops) - (1 if ops and math.isinf(ops[-1].t_answer) else 0)

    def total_ops(self) -> int:
        """Answered ops of all writers."""
        return sum(self.answered_ops(w) for w in self.ops)

    # -- applying ops ----------------------------------------------------------------------------

    @staticmethod
    def _effect(wid: str, op: Op, size: int) -> tuple[int, bytes, int]:
        """``(start, bytes laid there, size after)`` of ``op`` on a space of ``size`` bytes."""
        if op.kind == "w":
            return op.addr, op_data(wid, op.seq, op.n), max(size, op.addr + op.n)
        if op.addr < size:  # a shrink zeroes what it cuts (what lies past the size is zero)
            return op.addr, bytes(size - op.addr), op.addr
        return op.addr, b"", op.addr

    def advance(self, wid: str, upto: int) -> None:
        """Apply ``wid``'s ops up to (not including) ``upto`` to the state."""
        spec = self.specs[self.index[wid]]
        state, last = self.state[spec.space], self.last[spec.space]
        i = self.index[wid]
        for op in self.ops[wid][self.base[wid]:upto]:
            start, data, size = self._effect(wid, op, self.size[spec.space])
            state[start:start + len(data)] = np.frombuffer(data, dtype=np.uint8)
            last[start:start + len(data)] = (i << 32) | op.seq
            if spec.truncates:
                self.size[spec.space] = size
        self.base[wid] = max(self.base[wid], upto)

    def advance_all(self) -> None:
        """Every answered op applied (an op whose writer failed in it is not known to)."""
        for wid in self.ops:
            self.advance(wid, self.answered_ops(wid))

    def expected(self, space: str) -> np.ndarray:
        """The state of ``space`` (capacity bytes; zeros past ``size[space]``)."""
        return self.state[space]

    # -- checks ------------------------------------------------------------------------------

    def window(self, wid: str, t0: float, t1: float) -> tuple[int, int]:
        """``(a, b)``: ops answered before ``t0``, ops issued before ``t1``."""
        return (bisect.bisect_left(self.answered[wid], t0),
                bisect.bisect_left(self.issued[wid], t1))

    def check_copy(self, view: bytes, user: bytes, t0: float, t1: float, what: str
                   ) -> CopyVerdict:
        """Is ``view`` + ``user`` (a copy begun at ``t0`` and done at ``t1``) the tag at one
        instant in between? Every writer's bytes must be a prefix of its ops that holds every
        op answered before ``t0`` and none issued after ``t1``, the prefixes of one common
        instant; and every byte no writer owns must be as it was."""
        verdict = CopyVerdict()
        got = {"v": _padded(view, self.layout.capacity("v")),
               "u": _padded(user, self.layout.capacity("u"))}
        sizes = {"v": len(view), "u": len(user)}
        for space in ("v", "u"):
            loose = self.owner[space] == -1
            bad = np.flatnonzero(loose & (got[space] != self.initial[space]))
            if bad.size:
                verdict.problems.append(
                    f"{what}: {bad.size} bytes no writer owns differ from the initial ones "
                    f"({_space(space)} +{int(bad[0])} first)")
            if not any(s.truncates and s.space == space for s in self.specs) and \
                    sizes[space] != self.layout.initial_size(space):
                verdict.problems.append(f"{what}: {_space(space)} is {sizes[space]} bytes, "
                                        f"not {self.layout.initial_size(space)}")
        spans: list[tuple[float, float]] | None = [(t0, t1)]
        for spec in self.specs:
            a, b = self.window(spec.wid, t0, t1)
            self.advance(spec.wid, a)
            matches = self._matching_prefixes(spec, a, b, got[spec.space], sizes[spec.space])
            verdict.prefixes[spec.wid] = matches
            if not matches:
                verdict.problems.append(f"{what}: {spec.wid} holds no prefix of its writes "
                                        f"answered before it began ({a}) and issued before "
                                        f"it ended ({b}): "
                                        + self._diagnose(spec, a, b, got[spec.space],
                                                         sizes[spec.space]))
                continue
            spans = _intersect(spans or [], self._instants(spec.wid, matches))
        if not verdict.problems and not spans:
            verdict.problems.append(
                f"{what}: every writer holds a prefix of its writes, but no one instant has "
                "them all: " + ", ".join(f"{w} {p[0]}" + (f"..{p[-1]}" if len(p) > 1 else "")
                                         for w, p in verdict.prefixes.items()))
        return verdict

    def _matching_prefixes(self, spec: WriterSpec, a: int, b: int, got: np.ndarray,
                           got_size: int) -> list[int]:
        lo, hi = spec.box()
        own = self.owner[spec.space][lo:hi] == self.index[spec.wid]
        tmp = self.state[spec.space][lo:hi].copy()
        size = self.size[spec.space]
        cmp = got[lo:hi]
        diff = (tmp != cmp) & own
        wrong = int(np.count_nonzero(diff))
        matches = []
        ops = self.ops[spec.wid]
        for p in range(a, b + 1):
            if wrong == 0 and (not spec.truncates or size == got_size):
                matches.append(p)
            if p == b:
                break
            start, data, size_after = self._effect(spec.wid, ops[p], size)
            if spec.truncates:
                size = size_after
            if data:
                r0, r1 = start - lo, start - lo + len(data)
                before = int(np.count_nonzero(diff[r0:r1]))
                tmp[r0:r1] = np.frombuffer(data, dtype=np.uint8)
                diff[r0:r1] = (tmp[r0:r1] != cmp[r0:r1]) & own[r0:r1]
                wrong += int(np.count_nonzero(diff[r0:r1])) - before
        return matches

    def _instants(self, wid: str, prefixes: list[int]) -> list[tuple[float, float]]:
        """When the tag held exactly the first ``p`` ops of ``wid``: after op ``p-1`` was
        issued, before op ``p`` was answered."""
        out: list[tuple[float, float]] = []
        for p in prefixes:
            lo = self.issued[wid][p - 1] if p > 0 else -math.inf
            hi = self.answered[wid][p] if p < len(self.answered[wid]) else math.inf
            out.append((lo, hi))
        return out

    def _diagnose(self, spec: WriterSpec, a: int, b: int, got: np.ndarray, got_size: int
                  ) -> str:
        """Which of the writer's ops the copy holds: those answered before it began that are
        missing, and in the window which are in and which are not."""
        lo, hi = spec.box()
        space = spec.space
        own = self.owner[space][lo:hi] == self.index[spec.wid]
        ops = self.ops[spec.wid]
        tmp = self.state[space][lo:hi].copy()
        lastw = np.full(hi - lo, -1, dtype=np.int64)  # op of the window that wrote last
        befores: dict[int, np.ndarray] = {}
        size = self.size[space]
        sizes = [size]
        for p in range(a, b):
            start, data, size = self._effect(spec.wid, ops[p], size)
            sizes.append(size)
            if data:
                r0, r1 = start - lo, start - lo + len(data)
                befores[p] = tmp[r0:r1].copy()
                tmp[r0:r1] = np.frombuffer(data, dtype=np.uint8)
                lastw[r0:r1] = p
        cmp = got[lo:hi]
        parts = []
        # bytes last written before the window (answered before the copy began)
        base = self.state[space][lo:hi]
        old = np.flatnonzero(own & (lastw == -1) & (base != cmp))
        if old.size:
            first = int(old[0])
            tag = int(self.last[space][lo + first])
            seq = tag & 0xFFFFFFFF if tag >= 0 else None
            parts.append(f"{old.size} bytes written before it began are not in it (the first "
                         f"at +{lo + first}, " + (f"write #{seq}" if seq is not None else
                                                    "the initial bytes") + ")")
        status = []
        for p in range(a, b):
            op = ops[p]
            start, _, _ = self._effect(spec.wid, op, sizes[p - a])
            n = op.n if op.kind == "w" else len(befores.get(p, b""))
            if n == 0:
                status.append(f"#{p} truncate to {op.addr}: size only")
                continue
            r0 = start - lo
            vis = lastw[r0:r0 + n] == p
            if not vis.any():
                status.append(f"#{p} overwritten")
                continue
            want = tmp[r0:r0 + n][vis]
            have = cmp[r0:r0 + n][vis]
            if (want == have).all():
                status.append(f"#{p} in")
            elif p in befores and (befores[p][vis] == have).all():
                status.append(f"#{p} not in")
            else:
                status.append(f"#{p} mixed")
        if status:
            parts.append("window: " + ", ".join(status[:24]) + (" …" if len(status) > 24 else ""))
        if spec.truncates:
            parts.append(f"size {got_size}, the writer's sizes in the window {sizes}")
        return "; ".join(parts) or "its bytes match no prefix"

    def whose(self, space: str, pos: int) -> str:
        """Who wrote byte ``pos`` last, as the model has it (for messages)."""
        tag = int(self.last[space][pos])
        owner = int(self.owner[space][pos])
        if tag < 0:
            return (f"{self.specs[owner].wid}'s bytes, never written" if owner >= 0
                    else "nobody's bytes")
        spec = self.specs[tag >> 32]
        seq = tag & 0xFFFFFFFF
        op = self.ops[spec.wid][seq]
        return f"write #{seq} of {spec.wid} ({op.kind} {op.addr} +{op.n})"


def _padded(data: bytes, capacity: int) -> np.ndarray:
    arr = np.zeros(max(capacity, len(data)), dtype=np.uint8)
    arr[:len(data)] = np.frombuffer(data, dtype=np.uint8)
    return arr[:capacity]


def _space(space: str) -> str:
    return "the view" if space == "v" else "the user blob"


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]
               ) -> list[tuple[float, float]]:
    out = []
    for lo1, hi1 in a:
        for lo2, hi2 in b:
            lo, hi = max(lo1, lo2), min(hi1, hi2)
            if lo < hi:
                out.append((lo, hi))
    return out
