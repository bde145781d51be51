"""Case 2: crash consistency of writes, as JuiceFS's CI checks it.

A writer process runs the seeded ``writeops`` script through a mount — writes to the
whole-object view (growing it) and to ``chunk_N`` files, user blobs created in the tag
directory and written again — fsyncing after every op and appending the op's number to a log
outside the mount only once the fsync returned. The daemon is killed with SIGKILL mid-stream.
The store, as the kill left it, is copied; then:

1. the store is remounted over the dead mount and every logged write is verified;
2. after that mount's clean unmount, the store's staged clean blobs are removed (only
   ``writes/``, the registry and the tag states stay; the source is re-read) and it is
   mounted and verified again;
3. the copy made at the kill, stripped the same way, is mounted and verified: the journal
   alone, over the source, must give back every logged write.

Verification replays the script on a ``bytes`` model: the view and each user blob must read as
the ops before the one in flight, each chunk (and user blob) with or without the in-flight op
(it may be acknowledged without being logged; nothing may be torn within a blob), every
``chunk_N`` as its part of the view. The case fails if nothing was pending in the journal at
the kill (records not yet folded into dirty files), so it cannot pass vacuously. Trials take
three settings in turn: the defaults; folding often (``--dirty-mb 1 --journal-mb 1``), so some
writes are in dirty files and some only in the journal; and spilling often (``--dirty-mb 1``),
so the writes are read back from the journal rather than from memory.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from dataclasses import replace

from faultfs.store.dirty import DirtyFiles, folded_seq
from faultfs.store.journal import KIND_SIZE, Journal
from faultfs.store.writestate import WriteState
from faultfs.testing.torture.harness import (
    Budget,
    CaseResult,
    KiB,
    MiB,
    Mount,
    Run,
    TortureError,
    diff_bytes,
    read_all,
    wait_json,
)
from faultfs.testing.torture.writeops import WriteModel, WriteOp, take

NAME = "writes: crash consistency"
CHUNK = 256 * KiB
SOURCE_SIZE = 8 * MiB  # a whole number of chunks
TAG, VIEW = "crash", "crash.bin"
PAGE = 4096  # the kernel sends a write to FUSE in pages
MIN_LOGGED = 40  # the writer is well under way before the kill
WRITER_EXIT_S = 15.0


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    trials = 8
    kinds = [1] if run.quick else list(range(trials))  # --quick: one trial, the folding kind
    src, data = run.make_source(VIEW, SOURCE_SIZE, seed=run.seed + 2)
    rng = random.Random(f"crash:{run.seed}")
    logged_total = pending_total = 0
    verified = 0
    bad: list[str] = []
    vacuous = unretried = 0
    retries = 2  # a vacuous trial (killed just after a fold) runs again: same kind, new seed
    reruns: set[int] = set()
    early: list[str] = []
    mnt = run.fresh_dir("crash-mnt")
    for done, trial in enumerate(kinds):
        if budget.over() and trial not in reruns:  # (a vacuous trial's rerun: at most two)
            res.out_of_time(done, len(kinds), "trials")
            break
        seed = run.seed * 1000 + trial
        store = run.path(f"crash-store-{trial}")
        args = ["--chunk-size", str(CHUNK)] + ([], ["--dirty-mb", "1", "--journal-mb", "1"],
                                                ["--dirty-mb", "1"])[trial % 3]
        m = run.mount(src, store=store, mountpoint=mnt, args=args)
        log_path = run.path(f"crash-log-{trial}")
        open(log_path, "w").close()
        writer = run.worker("writer", "--dir", m.tag(TAG), "--view", VIEW, "--log", log_path,
                            "--seed", str(seed), "--source-size", str(SOURCE_SIZE),
                            "--chunk-size", str(CHUNK))
        deadline = time.monotonic() + 30
        while _count(log_path) < MIN_LOGGED and time.monotonic() < deadline:
            if writer.poll() is not None:
                break
            time.sleep(0.02)
        time.sleep(rng.uniform(0.1, 0.8))
        killed_at = time.monotonic()
        m.kill9()
        report = wait_json(writer, WRITER_EXIT_S)
        if report is None:
            writer.kill()
            writer.wait()
            raise TortureError("the writer did not leave the dead mount")
        if "error" in report and "logged" not in report:
            raise TortureError(f"the writer failed: {report['error']}")
        logged = _count(log_path)
        if logged < MIN_LOGGED:
            raise TortureError(f"the writer logged only {logged} ops before the kill "
                               f"({report.get('error')})")
        in_flight = report.get("in_flight") is not None
        failed_early = report.get("error_at") is not None and report["error_at"] < killed_at
        if failed_early:
            early.append(f"trial {trial}: op {report.get('in_flight')} failed "
                         f"{killed_at - report['error_at']:.2f} s before the kill: "
                         f"{report['error']}")
        pending = _pending(store, TAG)
        pending_total += pending
        logged_total += logged
        if pending == 0 and not failed_early:  # (a writer that failed first is its own failure)
            vacuous += 1
            if retries:
                retries -= 1
                rerun = max(kinds) + 3 - (max(kinds) - trial) % 3  # same kind, a new seed
                kinds.append(rerun)
                reruns.add(rerun)
            else:
                unretried += 1
        at_kill = store + "-at-kill"
        shutil.copytree(store, at_kill, symlinks=True)
        ops = take(seed, SOURCE_SIZE, CHUNK, logged + 1)
        prefix = WriteModel(bytearray(data), CHUNK)
        for op in ops[:logged]:
            prefix.apply(op)
        legal = [prefix]
        if in_flight:  # the kernel may have sent part of it (page by page) before the kill
            legal.extend(_partial_states(prefix, ops[logged]))
        new_user = ops[logged].name if in_flight and ops[logged].kind == "user_new" else None
        for label, path, where in (
            ("remount after the kill", store, mnt),
            ("clean blobs removed after a clean unmount", store, None),
            ("the store at the kill, clean blobs removed", at_kill, None),
        ):
            if label != "remount after the kill":
                _strip_clean(path)
            m2 = run.mount(store=path, mountpoint=where)
            problems = verify(m2, legal, new_user)
            if problems:
                problems.append(explain(m2, data, ops, logged))
            verified += 1
            m2.umount()
            bad.extend(f"trial {trial}, {label}: {p}" for p in problems[:3])
        res.notes.append(f"trial {trial}: {logged} ops logged, {pending} journal records pending "
                         f"at the kill, writer: {report.get('error')}")
        shutil.rmtree(at_kill, ignore_errors=True)
        shutil.rmtree(store, ignore_errors=True)
        res.trials += 1
    res.operations = logged_total
    res.check(not bad, f"every logged write read back in {verified} verifications "
              "(remount, clean blobs removed, the store at the kill re-read from the source)",
              f"{len(bad)} problems: " + "; ".join(bad[:4]))
    res.check(not early, "no write or fsync failed before the kill",
              f"{len(early)} writers failed before the kill: " + "; ".join(early[:2]))
    again = f"; {vacuous} vacuous trial(s) run again" if vacuous else ""
    res.check(unretried == 0 and pending_total > 0,
              f"{pending_total} journal records pending at the kills (none vacuous{again})",
              f"{unretried or vacuous} trials had nothing pending at the kill, also when run "
              "again")
    res.notes.extend(bad)


def _count(path: str) -> int:
    with open(path) as f:
        text = f.read()
    lines = text[:text.rfind("\n") + 1].splitlines()  # a line being written is not counted
    if lines != [str(i) for i in range(len(lines))]:
        raise TortureError(f"the writer's log {path} is not 0, 1, 2 …")
    return len(lines)


def _pending(store: str, tag: str) -> int:
    """Journal records of ``tag`` not folded into a dirty file (nor a saved view size)."""
    files = DirtyFiles(store, writable=False)
    folded = {}
    for name in files.names(tag):
        header = files.header(tag, name)
        folded[name] = folded_seq(header) if header is not None else 0
    view_seq = WriteState.parse(files.read_state(tag), 0).view_seq
    journal = Journal(os.path.join(store, "writes", "journal"))
    pending = 0
    for rec in journal.replay(writable=False):
        if rec.tag != tag:
            continue
        if rec.kind == KIND_SIZE and rec.name == "":
            pending += rec.seq > view_seq
        else:
            pending += rec.seq > folded.get(rec.name, 0)
    journal.close()
    return pending


def _strip_clean(store: str) -> None:
    """Remove every staged clean blob: keep ``writes/``, the registry tag and each tag.json."""
    tags = os.path.join(store, "tags")
    for entry in os.listdir(tags):
        if entry == "t-__cae_on_fault":
            continue
        directory = os.path.join(tags, entry)
        for name in os.listdir(directory):
            if name != "tag.json":
                os.unlink(os.path.join(directory, name))
    lock = os.path.join(store, "lock")
    if os.path.exists(lock):
        os.unlink(lock)


def _pad(buf: bytes | bytearray, i: int, cs: int) -> bytes:
    return bytes(buf[i * cs:(i + 1) * cs]).ljust(cs, b"\0")


def _partial_states(prefix: WriteModel, op: WriteOp) -> list[WriteModel]:
    """The op in flight at the kill applied to a prefix of its bytes that ends on a page
    boundary of the file (a write(2) the kernel split, answered in part), then whole."""
    base = op.off + (op.index * prefix.chunk_size if op.kind == "chunk" else 0)
    cuts = [c - base for c in range(-(-base // PAGE) * PAGE, base + len(op.data), PAGE)]
    out = []
    for length in [c for c in cuts if 0 < c < len(op.data)] + [len(op.data)]:
        state = prefix.copy()
        state.apply(replace(op, data=op.data[:length]))
        out.append(state)
    return out


def verify(m: Mount, legal: list[WriteModel], new_user: str | None) -> list[str]:
    """What differs from every state the crash may legally have left (empty: all held):
    ``legal[0]`` is the state after the logged ops, the others that state with the op in
    flight applied in part or whole. Each blob (a chunk, a user blob) must match one of them;
    nothing within a blob may mix two."""
    prefix = legal[0]
    cs = prefix.chunk_size
    problems: list[str] = []
    tag = m.tag(TAG)
    view = read_all(os.path.join(tag, VIEW))
    size = len(view)
    sizes = sorted({len(st.view) for st in legal})
    if size not in sizes:
        problems.append(f"view size {size}, expected one of {sizes}")
    for i in range(-(-size // cs)):
        got = view[i * cs:(i + 1) * cs]
        wants = [bytes(st.view[i * cs:(i + 1) * cs]).ljust(len(got), b"\0")[:len(got)]
                 for st in legal]
        if got not in wants:
            problems.append(f"view chunk {i}: {min(diff_bytes(got, w) for w in wants)} "
                            "bytes match no legal state")
    chunks = max(SOURCE_SIZE // cs, -(-size // cs))
    for i in range(chunks):
        got = read_all(os.path.join(tag, f"chunk_{i}"))
        wants = [_pad(st.view, i, cs) for st in legal]
        if got not in wants:
            problems.append(f"chunk_{i}: {min(diff_bytes(got, w) for w in wants)} bytes "
                            "differ from every legal state")
    names = {n for n in os.listdir(tag) if not n.startswith("chunk_") and n != VIEW}
    missing = set(prefix.users) - names
    extra = names - set(legal[-1].users)
    if missing or extra:
        problems.append(f"user blobs missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
    for name in sorted(names & set(legal[-1].users)):
        got = read_all(os.path.join(tag, name))
        wants = [bytes(st.users[name]) for st in legal if name in st.users]
        if name == new_user:
            wants.append(b"")  # created, its first write not yet answered
        if got not in wants:
            problems.append(f"user blob {name}: {len(got)} bytes match no legal state")
    return problems


def explain(m: Mount, source: bytes, ops: list, logged: int) -> str:
    """For each chunk of the view that matches no legal state: the longest prefix of the
    script it does match (the acknowledged writes it lost), or that it matches none."""
    cs = CHUNK
    view = read_all(os.path.join(m.tag(TAG), VIEW))
    out = []
    states = []
    model = WriteModel(bytearray(source), cs)
    states.append(model.copy())
    for op in ops:
        model.apply(op)
        states.append(model.copy())
    for i in range(-(-len(view) // cs)):
        got = view[i * cs:(i + 1) * cs]

        def chunk(st: WriteModel, i: int = i, n: int = len(got)) -> bytes:
            return bytes(st.view[i * cs:(i + 1) * cs]).ljust(n, b"\0")[:n]

        if got in (chunk(states[logged]), chunk(states[-1])):
            continue
        match = [k for k, st in enumerate(states) if chunk(st) == got]
        touching = [op.n for op in ops if _touches(op, i, cs)]
        out.append(f"view chunk {i} matches the state after ops {match[-3:] or 'none'} "
                   f"(logged {logged}); ops touching it: {touching[-6:]}")
    return "; ".join(out) or "no chunk of the view differs"


def _touches(op, i: int, cs: int) -> bool:
    if op.kind == "chunk":
        return op.index == i
    if op.kind == "view":
        return op.off < (i + 1) * cs and op.off + len(op.data) > i * cs
    return False
