"""The cross-name case's processes: writers that write a tag through one name and read every
write back at once through its other names, readers that keep every name cached, the holder
of a shared map of the view that answers reads for the writers, the cloner, and the steps
that prepare the tag and copy its bytes out. Every touch of the mount happens in one of
these, so the case's own process never waits on a mount that may hang.

``python -m faultfs.testing.torture.crossname_workers writers|reader|holder|cloner|prepare|dump
JSON``

Logs, one line each: ``I …`` an op issued and ``A …`` the op answered (``Op.line``; through
the shared map: once ``msync`` returned), ``R kind healed text`` a read back that was not
the bytes written, ``X seq t errno`` the op that failed, ``N t text`` what the process is
about to do; the last line says what a stuck process waits on, and every line is progress
for the watchdog. Each process prints one JSON report on stdout when it stops (SIGTERM, its
duration, or an error).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import mmap
import os
import random
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass

from faultfs.testing.torture.crossname_model import (
    UNIT,
    Layout,
    Op,
    WriterSpec,
    op_data,
    user_initial_bytes,
)

STALE_RECHECK_S = 0.05  # a read found wrong is read again this much later: does it heal?
HOLDER_TIMEOUT_S = 60.0
EXAMPLES = 5


class _Stop:
    requested = False


def _on_term(signum: int, frame: object) -> None:
    _Stop.requested = True


def _errname(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


class Names:
    """Descriptors of a tag's files, opened on first use (read-write; ``#2``: a second,
    read-only descriptor of the same file)."""

    def __init__(self, tag_dir: str) -> None:
        self.dir = tag_dir
        self.fds: dict[str, int] = {}

    def fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is None:
            base, _, again = name.partition("#")
            flags = os.O_RDONLY if again else os.O_RDWR
            fd = self.fds[name] = os.open(os.path.join(self.dir, base), flags)
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = {}


class HolderClient:
    """Reads through the shared map of the view that the holder process keeps."""

    def __init__(self, path: str) -> None:
        deadline = time.monotonic() + 30
        while True:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(HOLDER_TIMEOUT_S)

    def read(self, off: int, n: int) -> bytes:
        self.sock.sendall(struct.pack("<QI", off, n))
        out = b""
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise OSError(errno.EPIPE, "the holder of the view's map went away")
            out += got
        return out


def _note(log: int, text: str) -> None:
    """What this process is about to do, for the evidence of a hang (``N t text``)."""
    os.write(log, f"N {time.monotonic():.6f} {text}\n".encode())


# -- writers ----------------------------------------------------------------------------------

@dataclass
class Pending:
    """An op chosen and logged as issued, not yet answered."""

    op: Op
    how: str
    data: bytes
    before: bytes
    desc: str


class Writer:
    """One writer: its spec, its log, its own model of the bytes it owns, and the
    descriptors (and map of the view) it shares with another writer of its process."""

    def __init__(self, spec: WriterSpec, layout: Layout, args: dict, log: str, names: Names,
                 view_map: mmap.mmap | None, holder: HolderClient | None) -> None:
        self.spec = spec
        self.layout = layout
        self.names = names
        self.map = view_map
        self.holder = holder
        self.rng = random.Random(f"crossname:{args['seed']}:{spec.wid}")
        self.log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        cap = layout.capacity(spec.space)
        self.model = bytearray(cap)
        if spec.space == "v":
            with open(args["source"], "rb") as f:
                initial = f.read()
        else:
            initial = user_initial_bytes(layout, args["seed"])
        self.model[:len(initial)] = initial
        self.size = layout.initial_size(spec.space)
        self.pieces = [*spec.slots, *((u, u + UNIT) for u in spec.units)]
        self.seq = 0
        self.report: dict = {"wid": spec.wid, "ops": 0, "writes": 0, "truncates": 0,
                             "reads": 0, "stale": 0, "wrong": 0, "healed": 0, "examples": [],
                             "error": None, "stopped": "time"}

    def note(self, text: str) -> None:
        _note(self.log, text)

    # the next op: ("w", addr, n) or ("t", size, 0)
    def choose(self) -> tuple[str, int, int]:
        rng, spec = self.rng, self.spec
        if spec.tail is not None:
            lo, hi = spec.tail
            if rng.random() < 0.35:
                return "t", rng.randrange(lo, hi + 1), 0
            unit = lo + rng.randrange((hi - lo) // UNIT) * UNIT
            pieces = [(unit, unit + UNIT)]
        else:
            pieces = self.pieces
        r = rng.random()
        whole = [p for p in pieces if p[1] - p[0] == UNIT and p[0] % UNIT == 0]
        if r < 0.55 or not whole:  # unaligned: 100 bytes mostly, at any byte it owns
            lo, hi = rng.choice(pieces)
            n = min(hi - lo, 100 if rng.random() < 0.6 else rng.randrange(1, 301))
            return "w", rng.randrange(lo, hi - n + 1), n
        lo, _ = rng.choice(whole)
        if r < 0.85:  # a whole page, aligned
            return "w", lo, UNIT
        k = rng.randrange(1, UNIT // 512 + 1)  # 512-byte sectors, aligned
        start = rng.randrange(0, UNIT // 512 - k + 1) * 512
        return "w", lo + start, k * 512

    def begin(self) -> Pending:
        """Choose the next op and log it as issued."""
        kind, addr, n = self.choose()
        where = "the view" if self.spec.space == "v" else "the user blob"
        desc = (f"op #{self.seq}: write [{addr}, +{n}) of {where} through {self.spec.via}"
                if kind == "w" else f"op #{self.seq}: ftruncate {where} to {addr}")
        op = Op(self.seq, time.monotonic(), math.inf, kind, self.spec.space, addr, n)
        os.write(self.log, op.line(desc).encode())
        data = op_data(self.spec.wid, self.seq, n) if kind == "w" else b""
        before = bytes(self.model[addr:addr + n]) if kind == "w" else b""
        return Pending(op, self.spec.via, data, before, desc)

    def issue(self, p: Pending, sync: bool = True) -> None:
        """Do the op (through the map: copy the bytes in, and ``msync`` unless told not to
        yet)."""
        layout, space, op = self.layout, self.spec.space, p.op
        if op.kind == "t":
            name = layout.view_name if space == "v" else layout.user_name
            os.ftruncate(self.names.fd(name), op.addr)
            return
        if p.how == "mmap":
            assert self.map is not None
            self.map[op.addr:op.addr + op.n] = p.data
            if sync:
                self.sync(p)
            return
        where = layout.name_of(p.how, space, op.addr)
        assert where is not None, (p.how, space, op.addr)
        done = os.pwrite(self.names.fd(where[0]), p.data, where[1])
        if done != op.n:
            raise OSError(errno.EIO, f"short write: {done} of {op.n} bytes")

    def sync(self, p: Pending) -> None:
        assert self.map is not None
        start = p.op.addr - p.op.addr % mmap.PAGESIZE
        self.map.flush(start, p.op.addr + p.op.n - start)  # msync(MS_SYNC): answered

    def finish(self, p: Pending) -> None:
        """The op was answered: log it, then read it back through the other names."""
        op = dataclasses.replace(p.op, t_answer=time.monotonic())
        os.write(self.log, op.line().encode())
        if op.kind == "w":
            self.model[op.addr:op.addr + op.n] = p.data
            self.size = max(self.size, op.addr + op.n)
        else:
            if op.addr < self.size:
                self.model[op.addr:self.size] = bytes(self.size - op.addr)
            self.size = op.addr
        self.report["ops"] += 1
        self.report["writes" if op.kind == "w" else "truncates"] += 1
        self.seq += 1
        if op.kind == "w":
            self.verify(p.desc, op.addr, op.n, p.before)
        else:
            self.verify_truncate(op.addr)

    def failed(self, exc: OSError) -> None:
        self.report["error"] = f"op #{self.seq}: {_errname(exc)}: {exc}"
        self.report["stopped"] = "error"
        os.write(self.log, f"X {self.seq} {time.monotonic():.6f} {_errname(exc)}\n".encode())

    def read_back(self, check: str, addr: int, n: int) -> tuple[str, bytes]:
        """Bytes ``[addr, addr+n)`` of the writer's space through ``check``."""
        layout, space = self.layout, self.spec.space
        if check == "holder":
            assert self.holder is not None
            return "the holder's shared map of the view", self.holder.read(addr, n)
        if check == "map":
            assert self.map is not None
            return "this process's shared map of the view", self.map[addr:addr + n]
        if check == "user-again":
            return (f"a second descriptor of {layout.user_name}",
                    os.pread(self.names.fd(layout.user_name + "#2"), n, addr))
        where = layout.name_of(check, space, addr)
        assert where is not None, (check, space, addr)
        return where[0], os.pread(self.names.fd(where[0]), n, where[1])

    def verify(self, desc: str, addr: int, n: int, before: bytes) -> None:
        want = bytes(self.model[addr:addr + n])
        for check in self.spec.checks:
            name, got = self.read_back(check, addr, n)
            self.report["reads"] += 1
            if got == want:
                continue
            stale = got == before and len(got) == len(want)
            time.sleep(STALE_RECHECK_S)
            _, again = self.read_back(check, addr, n)
            healed = again == want
            differ = sum(a != b for a, b in zip(got, want, strict=False)) + \
                abs(len(got) - len(want))
            self.bad("stale" if stale else "wrong", healed,
                     f"{self.spec.wid}: {desc}, read back at once through {name}: "
                     f"{differ} of {len(want)} bytes "
                     + ("are the bytes from before the write (stale)" if stale else
                        "wrong (neither the new bytes nor the old)")
                     + (f"; right {STALE_RECHECK_S * 1000:.0f} ms later" if healed else
                        f"; still wrong {STALE_RECHECK_S * 1000:.0f} ms later"))

    def bad(self, kind: str, healed: bool, text: str) -> None:
        """A read back that was not what was written: counted, and logged at once (the
        case learns it even when this process is killed later)."""
        self.report[kind] += 1
        self.report["healed"] += healed
        if len(self.report["examples"]) < EXAMPLES:
            self.report["examples"].append(text)
        os.write(self.log, f"R {kind} {int(healed)} {text}\n".encode())

    def verify_truncate(self, size: int) -> None:
        """The new size through the path, and the bytes around the cut through another
        name (the chunk holding the last byte, or a second descriptor)."""
        layout, space = self.layout, self.spec.space
        name = layout.view_name if space == "v" else layout.user_name
        st = os.stat(os.path.join(self.names.dir, name))
        self.report["reads"] += 1
        if st.st_size != size:
            self.bad("wrong", False, f"{self.spec.wid}: truncated to {size}, stat of {name} "
                     f"says {st.st_size}")
        assert self.spec.tail is not None
        lo = max(self.spec.tail[0], size - 64)
        if space == "v":
            cs = layout.chunk_size
            c = (size - 1) // cs
            lo = max(lo, c * cs)
            hi = min(size + 64, (c + 1) * cs)
            chunk = f"chunk_{c}"
            got = os.pread(self.names.fd(chunk), hi - lo, lo - c * cs)
            want = bytes(self.model[lo:hi])
            where = chunk
        else:
            hi = size + 64
            got = os.pread(self.names.fd(layout.user_name + "#2"), hi - lo, lo)
            want = bytes(self.model[lo:size])
            where = f"a second descriptor of {name}"
        self.report["reads"] += 1
        if got != want:
            differ = sum(a != b for a, b in zip(got, want, strict=False))
            self.bad("wrong", False, f"{self.spec.wid}: truncated to {size}; [{lo}, {hi}) "
                     f"through {where} reads {len(got)} bytes, {differ} differ from the "
                     f"{len(want)} expected")


def writers(args: dict) -> dict:
    """The writers of one process: one, or (``one-process``) a writer through the map of the
    view and one through chunk_N, their ops interleaved so that each chunk_N write lands
    while the map holds an unsynced write: map write, chunk write (answered, read back),
    msync (the map write answered, read back)."""
    layout = Layout(**args["layout"])
    specs = [_spec(doc) for doc in args["specs"]]
    needs_map = any(s.via == "mmap" or "map" in s.checks for s in specs)
    for path in args["logs"]:  # every writer of the process says what it waits on
        log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        _note(log, "setting up: opening its names" + (", mapping the view" if needs_map else "")
              + (", connecting to the holder of the view's map"
                 if any("holder" in s.checks for s in specs) else ""))
        os.close(log)
    names = Names(args["tag_dir"])
    view_map = None
    if needs_map:
        view_map = mmap.mmap(names.fd(layout.view_name), layout.source_size)  # shared, rw
    holder = HolderClient(args["holder"]) if any("holder" in s.checks for s in specs) else None
    ws = [Writer(spec, layout, args, log, names, view_map, holder)
          for spec, log in zip(specs, args["logs"], strict=True)]
    deadline = time.monotonic() + args["duration"]
    mapped = next((w for w in ws if w.spec.via == "mmap"), None)
    others = [w for w in ws if w is not mapped]
    current = ws[0]
    try:
        while not _Stop.requested and time.monotonic() < deadline:
            if mapped is not None and others:  # the interleaved pair
                current = mapped
                held = mapped.begin()
                mapped.issue(held, sync=False)
                for w in others:
                    current = w
                    p = w.begin()
                    w.issue(p)
                    w.finish(p)
                current = mapped
                mapped.sync(held)
                mapped.finish(held)
            else:
                for w in ws:
                    current = w
                    p = w.begin()
                    w.issue(p)
                    w.finish(p)
    except OSError as exc:
        current.failed(exc)
    for w in ws:
        if _Stop.requested and w.report["stopped"] == "time":
            w.report["stopped"] = "signal"
    if view_map is not None:
        view_map.close()
    names.close()
    return {"writers": [w.report for w in ws]}


def _spec(doc: dict) -> WriterSpec:
    return WriterSpec(**{k: tuple(map(tuple, v)) if k == "slots" else
                         tuple(v) if isinstance(v, list) else v for k, v in doc.items()})


# -- the holder of the view's shared map --------------------------------------------------------

def holder(args: dict) -> dict:
    layout = Layout(**args["layout"])
    fd = os.open(os.path.join(args["tag_dir"], layout.view_name), os.O_RDONLY)
    view = mmap.mmap(fd, layout.source_size, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)  # the map outlives its descriptor, as numpy.memmap's does
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args["socket"])
    server.listen(64)
    served = [0]

    def serve(conn: socket.socket) -> None:
        with conn:
            while True:
                head = b""
                while len(head) < 12:
                    got = conn.recv(12 - len(head))
                    if not got:
                        return
                    head += got
                off, n = struct.unpack("<QI", head)
                conn.sendall(view[off:off + n])
                served[0] += 1

    server.settimeout(0.5)
    while not _Stop.requested:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    return {"served": served[0]}


# -- readers that keep the names' caches full --------------------------------------------------

def reader(args: dict) -> dict:
    """Read the tag without end, page by page at random, so that the kernel keeps caching
    every name while the writers write (``map``: through a shared map of the view, touching
    pages; ``names``: ``pread`` of the view, chunk_N, page:N and the user blob). Nothing is
    checked here: the bytes are in flux; what the writers read back is checked."""
    layout = Layout(**args["layout"])
    log = os.open(args["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    rng = random.Random(f"crossname-reader:{args['seed']}:{args['how']}")
    names = Names(args["tag_dir"])
    _note(log, "setting up: opening the names" + (", mapping the view"
                                                   if args["how"] == "map" else ""))
    view_map = None
    if args["how"] == "map":
        fd = os.open(os.path.join(args["tag_dir"], layout.view_name), os.O_RDONLY)
        view_map = mmap.mmap(fd, layout.source_size, mmap.MAP_SHARED, mmap.PROT_READ)
        os.close(fd)  # the map outlives its descriptor, as numpy.memmap's does
    deadline = time.monotonic() + args["duration"]
    reads = 0
    noted = time.monotonic()
    pages = layout.source_size // UNIT
    try:
        while not _Stop.requested and time.monotonic() < deadline:
            if view_map is not None:
                off = rng.randrange(pages) * UNIT
                what = f"a page of the map at {off}"
                _ = view_map[off:off + 64]
            else:
                how = rng.choice(("view", "chunk", "page", "user"))
                space = "u" if how == "user" or (how == "page" and rng.random() < 0.2) else "v"
                limit = layout.user_mapped if space == "u" else layout.source_size
                where = layout.name_of(how, space, rng.randrange(limit // UNIT) * UNIT)
                assert where is not None
                what = f"{where[0]} at {where[1]}"
                os.pread(names.fd(where[0] + "#2"), UNIT, where[1])
            reads += 1
            if time.monotonic() - noted > 0.25:
                noted = time.monotonic()
                _note(log, f"{reads} reads; the last: {what}")
    except OSError as exc:
        return {"reads": reads, "error": f"{_errname(exc)}: {exc}"}
    names.close()
    return {"reads": reads}


# -- clones -------------------------------------------------------------------------------------

def cloner(args: dict) -> dict:
    """``faultfs clone`` (its control request) every ``interval`` s; each clone's view and
    user blob copied out, then the clone before it forgotten (the last one is kept)."""
    from faultfs.control_client import request
    from faultfs.errors import FaultfsError

    layout = Layout(**args["layout"])
    root, tag, out = args["mount"], layout.tag, args["out"]
    log = os.open(args["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    report: dict = {"clones": 0, "failed": 0, "errors": [], "kept": None, "stopped": "time"}
    deadline = time.monotonic() + args["duration"]
    prev = None
    k = 0
    while not _Stop.requested and time.monotonic() < deadline:
        k += 1
        new = f"{tag}-copy{k}"
        t0 = time.monotonic()
        _note(log, f"clone {k}: faultfs clone {tag} {new}")
        try:
            request(root, {"op": "clone", "tag": tag, "new": new})
            t1 = time.monotonic()
            _note(log, f"clone {k}: copying {new}'s view and user blob out")
            for name, suffix in ((layout.view_name, "v"), (layout.user_name, "u")):
                with open(os.path.join(root, new, name), "rb") as src, \
                        open(os.path.join(out, f"{k}.{suffix}"), "wb") as dst:
                    dst.write(src.read())
            os.write(log, f"C {k} {t0:.6f} {t1:.6f}\n".encode())
            report["clones"] += 1
            if prev is not None:
                _note(log, f"clone {k}: faultfs forget {prev}")
                request(root, {"op": "forget", "tag": prev, "keep_blobs": False,
                               "discard_writes": True})
            prev = new
            report["kept"] = new
        except (OSError, FaultfsError) as exc:
            report["failed"] += 1
            if len(report["errors"]) < EXAMPLES:
                report["errors"].append(f"clone {k}: {exc}")
            _note(log, f"clone {k} failed: {exc}")
        pause = t0 + args["interval"] - time.monotonic()
        if pause > 0 and not _Stop.requested:
            time.sleep(pause)
    if _Stop.requested:
        report["stopped"] = "signal"
    return report


# -- setting up and copying out -----------------------------------------------------------------

def prepare(args: dict) -> dict:
    """The user blob with its initial bytes, then the pagemap over chunks and user blob."""
    layout = Layout(**args["layout"])
    tag_dir = args["tag_dir"]
    fd = os.open(os.path.join(tag_dir, layout.user_name), os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                 0o644)
    try:
        data = user_initial_bytes(layout, args["seed"])
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.EIO, "short write of the user blob")
        os.fsync(fd)
    finally:
        os.close(fd)
    with open(os.path.join(tag_dir, ".pagemap"), "w") as f:
        f.write(layout.pagemap_text())
    names = set(os.listdir(tag_dir))
    want = {f"page:{i}" for i in range(layout.num_pages)}
    if not want <= names:
        return {"error": f"the pagemap shows {len(want & names)} of {len(want)} pages"}
    return {"ok": True}


def dump(args: dict) -> dict:
    """Copy each of ``names`` of ``tag_dir`` whole into ``out`` (a missing one: null)."""
    sizes: dict[str, int | None] = {}
    for name in args["names"]:
        try:
            with open(os.path.join(args["tag_dir"], name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            sizes[name] = None
            continue
        with open(os.path.join(args["out"], name.replace(":", "_")), "wb") as f:
            f.write(data)
        sizes[name] = len(data)
    return {"sizes": sizes}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    what, args = argv[0], json.loads(argv[1])
    signal.signal(signal.SIGTERM, _on_term)
    if what == "writers":
        report = writers(args)
    elif what == "reader":
        report = reader(args)
    elif what == "holder":
        report = holder(args)
    elif what == "cloner":
        report = cloner(args)
    elif what == "prepare":
        report = prepare(args)
    elif what == "dump":
        report = dump(args)
    else:
        raise SystemExit(f"unknown worker {what}")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
