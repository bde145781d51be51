"""Case 8: crossname — writers through every pair of one tag's names at once, each write read
back at once through the other names, clones taken under that load checked against the
writers' logs, and a watchdog that turns a hang into a failure with the stacks.

One tag (a 2 MiB source in 64 KiB chunks, a user blob, a pagemap laying the chunks and then
the user blob's head in 48 KiB pages, so a page straddles chunks and one straddles a chunk and
the user blob). Its bytes are split among writer processes (``crossname_model``): each part
gives an area to a pair of writers, one writing through each name — view × chunk_N, a shared
writable map of the view (answered at ``msync``) × chunk_N, page:N × chunk_N, view × page:N,
user blob × page:N — whose bytes interleave inside kernel pages; one process writing into its
map of the view and then, before the ``msync``, through chunk_N; two writers that write and
``ftruncate`` the view's tail and the user blob's tail; and two readers that keep every name
cached. Aligned and unaligned ``pwrite``s (100 bytes at random offsets, whole pages, sectors).
After every answered write its writer reads the bytes back through the other names (and, for
chunk_N writes beside the map, through the shared map of the view another process holds, the
holder). Meanwhile the tag is cloned every 0.5 s; each clone's
bytes are checked against the logs: for every writer a prefix of its ops holding every op
answered before the clone began and none issued after it ended, the prefixes of one instant.
At the end the whole tag — view, user blob, every chunk_N and page:N — is compared with the
model of the logs, then again after an unmount and a remount, with the last clone.

The case's own process never touches the mount: every read and write is a worker's, every
wait has a bound. A worker that makes no progress for ``WATCHDOG_S`` is a hang: the kernel
stacks of the stuck processes and of the daemon's threads and the daemon's Python stacks are
kept, the FUSE connection is aborted, everything is killed and the mount detached.

``--crossname-parts`` chooses the parts (``crossname_model.PARTS``) or single writers, e.g.
``all,-mmap-chunk,-one-process`` or ``mmap-chunk/chunk,readers,clones``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from faultfs.testing.torture.crossname_model import (
    Layout,
    Model,
    Op,
    WriterSpec,
    parse_parts,
    user_initial_bytes,
    writer_specs,
)
from faultfs.testing.torture.harness import Budget, CaseResult, Mount, Run, TortureError, log
from faultfs.testing.torture.watchdog import Hang, free_mount, gather

NAME = "crossname: writers through every pair of names, clones"
WATCHDOG_S = 20.0  # no progress from a worker for this long is a hang
CLONE_INTERVAL_S = 0.5
STEP_TIMEOUT_S = 60.0  # preparing the tag, copying it out
STOP_S = 20.0  # a writer told to stop finishes its op and exits within this
FINAL_S = {True: 12.0, False: 30.0}  # of the budget, kept for the end (quick: True)
POLL_S = 0.2
WORKERS = "faultfs.testing.torture.crossname_workers"


@dataclass
class Tail:
    """A log read as it grows: complete lines only, and when it last grew."""

    path: str
    offset: int = 0
    partial: bytes = b""
    grew_at: float = field(default_factory=time.monotonic)
    last_intent: str = ""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        if not data:
            return []
        self.offset += len(data)
        self.grew_at = time.monotonic()
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        return [line.decode() for line in complete]


@dataclass
class Worker:
    label: str
    proc: subprocess.Popen
    tail: Tail | None = None
    report: dict | None = None
    wid: str = ""


class CrossName:
    def __init__(self, run: Run, res: CaseResult, m: Mount, layout: Layout,
                 specs: list[WriterSpec], parts: list[str], src: str, view0: bytes,
                 user0: bytes) -> None:
        self.run, self.res, self.m, self.layout = run, res, m, layout
        self.specs, self.parts, self.src = specs, parts, src
        self.tag_dir = m.tag(layout.tag)
        self.model = Model(layout, specs, view0, user0)
        self.dir = run.fresh_dir("crossname")
        self.copies = os.path.join(self.dir, "clones")
        os.makedirs(self.copies)
        self.writers: dict[str, Worker] = {}
        self.others: dict[str, Worker] = {}  # the holder, the cloner
        self.pending: list[tuple[int, float, float]] = []
        self.clones_checked = 0
        self.bad_clones: list[str] = []
        self.last_copy: int | None = None
        self.stale = self.wrong = self.reads = self.healed = 0
        self.examples: list[str] = []
        self.errors: list[str] = []
        self.completed = False  # the writers ran their time and the end was checked
        self.reports: dict[int, dict] = {}  # pid -> what the process printed
        self.others_reads = 0  # the readers'
        self.stderr: dict[int, str] = {}  # pid -> its stderr file
        self._spawned = 0

    # -- workers -----------------------------------------------------------------------------

    def _args(self, **extra) -> str:
        layout = {k: getattr(self.layout, k) for k in Layout.__dataclass_fields__}
        return json.dumps({"layout": layout, "tag_dir": self.tag_dir, "seed": self.run.seed,
                           **extra})

    def _spawn(self, what: str, args: str) -> subprocess.Popen:
        """A worker; its report on stdout, its stderr into a file (a pipe nobody reads
        until the end could fill and stop it)."""
        self._spawned += 1
        err = os.path.join(self.dir, f"{what}-{self._spawned}.err")
        with open(err, "wb") as f:
            proc = self.run.popen([sys.executable, "-m", WORKERS, what, args],
                                  stdout=subprocess.PIPE, stderr=f, text=True)
        self.stderr[proc.pid] = err
        return proc

    def _stderr(self, proc: subprocess.Popen) -> str:
        return _read(self.stderr.get(proc.pid, "")).decode(errors="replace").strip()[-400:]

    def step(self, what: str, **extra) -> dict:
        """A one-shot worker (prepare, dump), bounded: a Hang when it does not return."""
        proc = self._spawn(what, self._args(**extra))
        try:
            out, _ = proc.communicate(timeout=STEP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise Hang(f"{what} did not return in {STEP_TIMEOUT_S:.0f} s",
                       {what: (proc.pid, what)}) from None
        try:
            report = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise TortureError(f"{what} failed (exit {proc.returncode}): "
                               f"{self._stderr(proc)}") from None
        if report.get("error"):
            raise TortureError(f"{what}: {report['error']}")
        return report

    def start(self, duration: float) -> None:
        if any("holder" in s.checks for s in self.specs):
            sock = os.path.join(self.dir, "holder.sock")
            self.others["holder"] = Worker("the holder of the view's map",
                                           self._spawn("holder", self._args(socket=sock)))
        else:
            sock = ""
        groups: dict[str, list[WriterSpec]] = {}  # the one-process pair shares a process
        for spec in self.specs:
            groups.setdefault(spec.part if spec.part == "one-process" else spec.wid,
                              []).append(spec)
        for group in groups.values():
            logs = [os.path.join(self.dir, spec.wid.replace("/", "_") + ".log")
                    for spec in group]
            docs = [{k: getattr(spec, k) for k in WriterSpec.__dataclass_fields__}
                    for spec in group]
            proc = self._spawn("writers", self._args(specs=docs, logs=logs, source=self.src,
                                                     holder=sock, duration=duration + 60))
            for spec, path in zip(group, logs, strict=True):
                self.writers[spec.wid] = Worker(f"writer {spec.wid}", proc, Tail(path),
                                                wid=spec.wid)
        if "readers" in self.parts:
            for how in ("map", "names"):
                path = os.path.join(self.dir, f"reader-{how}.log")
                proc = self._spawn("reader", self._args(how=how, log=path,
                                                        duration=duration + 60))
                self.others[f"reader-{how}"] = Worker(
                    f"the reader through {'a shared map of the view' if how == 'map' else 'every name'}",
                    proc, Tail(path))
        if "clones" in self.parts:
            path = os.path.join(self.dir, "cloner.log")
            proc = self._spawn("cloner", self._args(mount=self.m.path, out=self.copies, log=path,
                                                    interval=CLONE_INTERVAL_S,
                                                    duration=duration + 60))
            self.others["cloner"] = Worker("the cloner", proc, Tail(path))

    def poll(self) -> None:
        """Read what the logs say since the last look; check the clones that can be."""
        for wid, w in self.writers.items():
            assert w.tail is not None
            for line in w.tail.lines():
                if line.startswith(("A ", "I ")):
                    parsed = Op.parse(line)
                    if parsed is not None:
                        self.model.add(wid, parsed[0])
                        w.tail.last_intent = parsed[1] or f"op #{parsed[0].seq} answered"
                elif line.startswith(("N ", "X ")):
                    w.tail.last_intent = line.split(" ", 2)[-1]
                elif line.startswith("R "):
                    _, kind, healed, text = line.split(" ", 3)
                    if kind == "stale":
                        self.stale += 1
                    else:
                        self.wrong += 1
                    self.healed += int(healed)
                    if len(self.examples) < 20:
                        self.examples.append(text)
        for key, other in self.others.items():
            if other.tail is None:
                continue
            for line in other.tail.lines():
                f = line.split(" ", 3)
                if f[0] == "C" and key == "cloner":
                    self.pending.append((int(f[1]), float(f[2]), float(f[3])))
                elif f[0] == "N":
                    other.tail.last_intent = line.split(" ", 2)[-1]
        self.check_clones()

    def _done(self, w: Worker) -> bool:
        return w.proc.poll() is not None

    def check_clones(self) -> None:
        while self.pending:
            k, t0, t1 = self.pending[0]
            for wid, w in self.writers.items():  # every op issued before t1 is logged
                issued = self.model.issued[wid]
                if not self._done(w) and (not issued or issued[-1] < t1):
                    return
            self.pending.pop(0)
            view = _read(os.path.join(self.copies, f"{k}.v"))
            user = _read(os.path.join(self.copies, f"{k}.u"))
            verdict = self.model.check_copy(view, user, t0, t1, f"clone {k}")
            self.clones_checked += 1
            if not verdict.ok:
                self.bad_clones.append(f"clone {k} ({(t1 - t0) * 1000:.0f} ms): "
                                       + "; ".join(verdict.problems))
            if self.last_copy is not None:
                for suffix in ("v", "u"):
                    _remove(os.path.join(self.copies, f"{self.last_copy}.{suffix}"))
            self.last_copy = k

    def watch(self, until: float) -> None:
        """Poll until ``until``; a Hang when a running worker made no progress for
        ``WATCHDOG_S``; a writer that stopped by itself is collected."""
        while time.monotonic() < until:
            self.poll()
            now = time.monotonic()
            stuck = {}
            for w in [*self.writers.values(), *self.others.values()]:
                if w.tail is None or self._done(w):
                    continue
                if now - w.tail.grew_at > WATCHDOG_S:
                    stuck[w.label] = (w.proc.pid, w.tail.last_intent)
            if stuck:
                watched = sum(1 for w in [*self.writers.values(), *self.others.values()]
                              if w.tail is not None)
                raise Hang(f"no progress for {WATCHDOG_S:.0f} s from {len(stuck)} of "
                           f"{watched} workers",
                           stuck | self._also_waiting(stuck))
            time.sleep(POLL_S)

    def _also_waiting(self, stuck: dict) -> dict:
        """The other live workers, for the evidence (what they wait on tells the story)."""
        out = {}
        for w in [*self.writers.values(), *self.others.values()]:
            if w.label not in stuck and not self._done(w):
                out[w.label] = (w.proc.pid, w.tail.last_intent if w.tail else
                                "serving reads through its shared map of the view")
        return out

    def stop(self) -> None:
        """Tell the writers and the cloner to stop, and collect their reports (a Hang when
        one does not stop)."""
        workers = [*self.writers.values(), *self.others.values()]
        # the writers first: a writer ends the op under way, whose read back may go through
        # the holder's map (a holder stopped with them went away under that read, once)
        for group in (list(self.writers.values()), list(self.others.values())):
            for w in group:
                if not self._done(w):
                    w.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + STOP_S
            while time.monotonic() < deadline and not all(self._done(w) for w in group):
                self.poll()
                time.sleep(POLL_S)
            left = {w.label: (w.proc.pid, w.tail.last_intent if w.tail else "")
                    for w in group if not self._done(w)}
            if left:
                raise Hang(f"{len(left)} workers did not stop within {STOP_S:.0f} s of "
                           "SIGTERM", left)
        for w in workers:
            self._collect(w)
        self.poll()

    def _collect(self, w: Worker) -> None:
        if w.report is not None:
            return
        report = self.reports.get(w.proc.pid)
        if report is None:
            try:
                out, _ = w.proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                return
            try:
                report = json.loads(out.strip().splitlines()[-1])
            except (ValueError, IndexError):
                report = {}
                self.errors.append(f"{w.label} exited {w.proc.returncode} without a report: "
                                   f"{self._stderr(w.proc)}")
            self.reports[w.proc.pid] = report
        mine = [r for r in report.get("writers", []) if r.get("wid") == w.wid]
        r = w.report = mine[0] if mine else report
        if r.get("error"):
            self.errors.append(f"{w.label}: {r['error']}")
        if w.wid:
            self.reads += r.get("reads", 0)
        else:
            self.others_reads += r.get("reads", 0)
        for e in r.get("errors", []):
            self.errors.append(f"{w.label}: {e}")

    def collect_exited(self) -> None:
        for w in [*self.writers.values(), *self.others.values()]:
            if self._done(w):
                self._collect(w)

    # -- the end -----------------------------------------------------------------------------

    def names(self) -> list[str]:
        size_v = int(self.model.size["v"])
        chunks = max(self.layout.num_chunks, -(-size_v // self.layout.chunk_size))
        return ([self.layout.view_name, self.layout.user_name]
                + [f"chunk_{i}" for i in range(chunks)]
                + [f"page:{i}" for i in range(self.layout.num_pages)])

    def compare_tag(self, tag_dir: str, when: str) -> list[str]:
        """Every name of the tag against the model (all ops applied)."""
        out = os.path.join(self.dir, f"dump-{when.replace(' ', '-')}")
        os.makedirs(out)
        names = self.names()
        sizes = self.step("dump", names=names, out=out, tag_dir=tag_dir)["sizes"]
        model, layout = self.model, self.layout
        view = model.expected("v")
        user = model.expected("u")
        problems = []

        def against(name: str, want: np.ndarray, where) -> None:
            if sizes.get(name) is None:
                problems.append(f"{when}: {name} is missing")
                return
            got = np.frombuffer(_read(os.path.join(out, name.replace(":", "_"))),
                                dtype=np.uint8)
            n = min(len(got), len(want))
            bad = np.flatnonzero(got[:n] != want[:n])
            if bad.size or len(got) != len(want):
                first = int(bad[0]) if bad.size else n
                space, pos = where(first)
                problems.append(
                    f"{when}: {name} has {bad.size} wrong bytes"
                    + (f" and {len(got)} bytes, not {len(want)}" if len(got) != len(want)
                       else "")
                    + f"; the first at +{first}: "
                    + (model.whose(space, pos) if pos < layout.capacity(space) else "past "
                       "the end"))

        size_v, size_u = int(model.size["v"]), int(model.size["u"])
        against(layout.view_name, view[:size_v], lambda i: ("v", i))
        against(layout.user_name, user[:size_u], lambda i: ("u", i))
        cs, ps, s = layout.chunk_size, layout.page_size, layout.source_size

        def in_page(j: int, k: int) -> tuple[str, int]:
            x = j * ps + k
            return ("v", x) if x < s else ("u", x - s)

        for name in names:
            if name.startswith("chunk_"):
                i = int(name[6:])
                want = np.zeros(cs, dtype=np.uint8)
                piece = view[i * cs:(i + 1) * cs]
                want[:len(piece)] = piece
                against(name, want, lambda k, i=i: ("v", i * cs + k))
            elif name.startswith("page:"):
                j = int(name[5:])
                against(name, layout.page_bytes(j, view, user), lambda k, j=j: in_page(j, k))
        return problems

    def _umount(self) -> None:
        try:
            self.m.umount()
        except subprocess.TimeoutExpired:
            raise Hang("faultfs umount did not return", {}) from None

    def finish(self) -> None:
        self.model.advance_all()
        names = len(self.names())
        problems = self.compare_tag(self.tag_dir, "at the end")
        checked = 1
        self._umount()
        try:
            self.m = self.run.mount(store=self.m.store, mountpoint=self.m.path)
        except subprocess.TimeoutExpired:
            raise Hang("faultfs mount (the remount) did not return", {}) from None
        problems += self.compare_tag(self.tag_dir, "after the remount")
        checked += 1
        kept = (self.others["cloner"].report or {}).get("kept") if "cloner" in self.others \
            else None
        clone_line = ""
        if kept and self.last_copy is not None and kept.endswith(f"copy{self.last_copy}"):
            out = os.path.join(self.dir, "kept-clone")
            os.makedirs(out)
            clone_dir = os.path.join(self.m.path, kept)
            self.step("dump", names=[self.layout.view_name, self.layout.user_name], out=out,
                      tag_dir=clone_dir)
            for name, suffix in ((self.layout.view_name, "v"), (self.layout.user_name, "u")):
                then = _read(os.path.join(self.copies, f"{self.last_copy}.{suffix}"))
                now = _read(os.path.join(out, name))
                if then != now:
                    problems.append(f"after the remount: {kept}/{name} is not what it was "
                                    f"when taken ({len(now)} bytes, {len(then)} then)")
            checked += 1
            clone_line = f", and the last clone ({kept}) as it was taken"
        self._umount()
        self.completed = True
        self.res.trials += checked
        self.res.check(not problems,
                       f"the whole tag ({names} names: view, user blob, every chunk_N and "
                       f"page:N) as the logs say, also after an unmount and a remount"
                       + clone_line,
                       f"{len(problems)} names differ from the logs: " + "; ".join(problems[:3]))
        self.res.notes.extend(problems[:40])

    def summarize(self) -> None:
        res, model = self.res, self.model
        writes = sum(1 for w, ops in model.ops.items()
                     for op in ops[:model.answered_ops(w)] if op.kind == "w")
        truncs = model.total_ops() - writes
        res.operations = model.total_ops()
        res.trials += self.clones_checked
        res.notes.append("writers: " + ", ".join(self.parts))
        res.notes.append("ops per writer: " + ", ".join(f"{w} {len(o)}"
                                                         for w, o in model.ops.items()))
        if "readers" in self.parts and self.others_reads:
            res.notes.append(f"the readers read {self.others_reads:,} pieces meanwhile")
        reads, about = self.reads, ""
        for spec in self.specs:  # a writer killed at a hang made no report: its ops tell
            report = self.writers[spec.wid].report if spec.wid in self.writers else None
            if not report or "reads" not in report:
                reads += len(model.ops[spec.wid]) * max(2, len(spec.checks))
                about = "about "
        if self.writers:
            res.check(self.stale + self.wrong == 0,
                      f"{about}{reads:,} reads back through the other names right after "
                      f"{writes:,} writes and {truncs:,} truncates by {len(self.writers)} "
                      "writers: none stale, none wrong",
                      f"{self.stale} stale and {self.wrong} wrong reads back through another "
                      f"name right after a write, of {about}{reads:,} ({self.healed} right "
                      "50 ms later); first: " + (self.examples[0] if self.examples else "-"))
            res.notes.extend(self.examples[:20])
        if "clones" in self.parts:
            cloner = self.others.get("cloner")
            report = cloner.report if cloner is not None and cloner.report else {}
            if not self.clones_checked and not self.completed:
                res.notes.append("no clone was checked before the run stopped")
            else:
                res.check(bool(self.clones_checked) and not self.bad_clones,
                          f"{self.clones_checked} clones taken under the writers, each the "
                          "tag at one instant by the writers' logs",
                          f"{len(self.bad_clones)} of {self.clones_checked} clones not "
                          "point-in-time; first: " + (self.bad_clones[0] if self.bad_clones
                                                      else "no clone was checked"))
            res.notes.extend(self.bad_clones[:20])
            if report.get("failed"):
                self.errors.append(f"{report['failed']} clones failed: "
                                   + "; ".join(report.get("errors", [])))
        if self.errors:
            res.failed.append(f"{len(self.errors)} workers failed: " + "; ".join(self.errors[:3]))
            res.notes.extend(self.errors)


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    parts = parse_parts(run.options.get("crossname_parts"))
    layout = Layout()
    specs = writer_specs(layout, parts)
    src, view0 = run.make_source(layout.view_name, layout.source_size, seed=run.seed + 41)
    user0 = user_initial_bytes(layout, run.seed)
    store = run.fresh_dir("crossname-store")
    m = run.mount(src, store=store, args=["--chunk-size", str(layout.chunk_size)])
    case = CrossName(run, res, m, layout, specs, parts, src, view0, user0)
    try:
        case.step("prepare")
        duration = max(5.0, budget.left() - FINAL_S[run.quick])
        log(f"crossname: {', '.join(parts)} for {duration:.0f} s")
        case.start(duration)
        case.watch(time.monotonic() + duration)
        case.stop()
        case.collect_exited()
        case.finish()
    except Hang as hang:
        evidence = gather(hang, case.m.pid)
        pids = [w.proc.pid for w in [*case.writers.values(), *case.others.values()]
                if w.proc.poll() is None] + [pid for pid, _ in hang.stuck.values()]
        problems = free_mount(run, case.m, sorted(set(pids)))
        res.failed.append(evidence.summary + "; the mount was freed (FUSE connection aborted, "
                          "daemon and workers killed)" + (f", but: {'; '.join(problems)}"
                                                          if problems else ""))
        res.notes.extend(evidence.notes)
        case.poll()  # what the logs said before the abort (what came after is its echo)
    finally:
        case.summarize()


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
