"""Case 3: fsrand — one seeded random script of file operations, run on a local directory that
holds copies of the sources and on the mount, then the two trees compared byte for byte.

Two tags (different chunk sizes, one source not a whole number of chunks). Operations: reads
of the view, of ``chunk_N`` and of user blobs (each compared at once with the local copy),
writes and truncates of the view, mmap writes of the view, fsyncs, and user blobs created,
written, truncated, renamed (also over another user blob) and unlinked. Every operation must
have the same outcome on both sides — the same bytes, the same size, or the same errno.
After the script the trees are compared, then again after an unmount and a remount.

What must hold: no operation differs, no byte differs, before or after the remount.
"""

from __future__ import annotations

import errno
import mmap
import os
import random

from faultfs.testing.torture.harness import Budget, CaseResult, KiB, MiB, Run, read_all

NAME = "fsrand: mount vs local tree"
TAGS = (("alpha", 3 * MiB + 777, 256 * KiB), ("beta", MiB + 5, 64 * KiB))
USER_NAMES = tuple(f"u{i:02d}.dat" for i in range(10))


class Side:
    """One tree: the local directory or the mount's, with the views held open read-write."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.views = {tag: os.open(os.path.join(root, tag, f"{tag}.bin"), os.O_RDWR)
                      for tag, _, _ in TAGS}

    def path(self, tag: str, name: str) -> str:
        return os.path.join(self.root, tag, name)

    def close(self) -> None:
        for fd in self.views.values():
            os.close(fd)
        self.views = {}


def _outcome(fn, *args):
    """What a call did: its result, or the errno it failed with."""
    try:
        return ("ok", fn(*args))
    except OSError as exc:
        return ("errno", errno.errorcode.get(exc.errno or 0, exc.errno))


def _read_file(path: str, off: int, n: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, n, off)
    finally:
        os.close(fd)


def _write_file(path: str, off: int, data: bytes, create: bool) -> int:
    flags = os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        return os.pwrite(fd, data, off)
    finally:
        os.close(fd)


def _mmap_write(fd: int, off: int, data: bytes) -> int:
    size = os.fstat(fd).st_size
    with mmap.mmap(fd, size) as mm:
        mm[off:off + len(data)] = data
        mm.flush()
    return len(data)


def step(rng: random.Random, local: Side, mount: Side, chunk_sizes: dict[str, int]
         ) -> tuple[str, object, object]:
    """One random operation on both sides: ``(what, local outcome, mount outcome)``."""
    tag = rng.choice(list(chunk_sizes))
    cs = chunk_sizes[tag]
    lv, mv = local.views[tag], mount.views[tag]
    size = os.fstat(lv).st_size
    r = rng.random()
    if r < 0.22:
        off, n = rng.randrange(0, size + 100), rng.randrange(1, 300 * KiB)
        return f"read {tag} view [{off}, +{n})", _outcome(os.pread, lv, n, off), \
            _outcome(os.pread, mv, n, off)
    if r < 0.30:
        chunks = max(1, -(-size // cs))
        i = rng.randrange(chunks)
        off, n = rng.randrange(cs), rng.randrange(1, cs + 1)
        want = os.pread(lv, min(n, cs - off), i * cs + off) if size > i * cs + off else b""
        want = want.ljust(min(n, cs - off), b"\0")  # a chunk is chunk-size bytes, zero-filled
        got = _outcome(_read_file, mount.path(tag, f"chunk_{i}"), off, n)
        return f"read {tag} chunk_{i} [{off}, +{n})", ("ok", want), got
    if r < 0.48:
        off = rng.randrange(0, size + 64 * KiB)
        data = rng.randbytes(rng.randrange(1, 70 * KiB))
        return f"write {tag} view [{off}, +{len(data)})", _outcome(os.pwrite, lv, data, off), \
            _outcome(os.pwrite, mv, data, off)
    if r < 0.54:
        new = rng.randrange(0, 2 * size + cs)
        return f"truncate {tag} view to {new}", _outcome(os.ftruncate, lv, new), \
            _outcome(os.ftruncate, mv, new)
    if r < 0.60:
        if size == 0:
            return "mmap of an empty view (skipped)", ("ok", 0), ("ok", 0)
        off = rng.randrange(size)
        data = rng.randbytes(min(size - off, rng.randrange(1, 9000)))
        return f"mmap write {tag} view [{off}, +{len(data)})", \
            _outcome(_mmap_write, lv, off, data), _outcome(_mmap_write, mv, off, data)
    if r < 0.63:
        return f"fsync {tag} view", _outcome(os.fsync, lv), _outcome(os.fsync, mv)
    name = rng.choice(USER_NAMES)
    if r < 0.71:
        data = rng.randbytes(rng.randrange(0, 40 * KiB))
        return f"create {tag}/{name}", \
            _outcome(_write_file, local.path(tag, name), 0, data, True), \
            _outcome(_write_file, mount.path(tag, name), 0, data, True)
    if r < 0.80:
        off = rng.randrange(0, 48 * KiB)
        data = rng.randbytes(rng.randrange(1, 20 * KiB))
        return f"write {tag}/{name} [{off}, +{len(data)})", \
            _outcome(_write_file, local.path(tag, name), off, data, False), \
            _outcome(_write_file, mount.path(tag, name), off, data, False)
    if r < 0.86:
        off, n = rng.randrange(0, 50 * KiB), rng.randrange(1, 60 * KiB)
        return f"read {tag}/{name} [{off}, +{n})", \
            _outcome(_read_file, local.path(tag, name), off, n), \
            _outcome(_read_file, mount.path(tag, name), off, n)
    if r < 0.90:
        new = rng.randrange(0, 64 * KiB)
        return f"truncate {tag}/{name} to {new}", \
            _outcome(os.truncate, local.path(tag, name), new), \
            _outcome(os.truncate, mount.path(tag, name), new)
    if r < 0.96:
        dst = rng.choice(USER_NAMES)
        return f"rename {tag}/{name} to {dst}", \
            _outcome(os.rename, local.path(tag, name), local.path(tag, dst)), \
            _outcome(os.rename, mount.path(tag, name), mount.path(tag, dst))
    return f"unlink {tag}/{name}", _outcome(os.unlink, local.path(tag, name)), \
        _outcome(os.unlink, mount.path(tag, name))


def compare_trees(local_root: str, mount_root: str, chunk_sizes: dict[str, int]) -> list[str]:
    """Differences between the local tree and the mount's (chunk files against the view)."""
    problems = []
    for tag, cs in chunk_sizes.items():
        lnames = sorted(os.listdir(os.path.join(local_root, tag)))
        mnames = sorted(n for n in os.listdir(os.path.join(mount_root, tag))
                        if not n.startswith("chunk_"))
        if lnames != mnames:
            problems.append(f"{tag}: names differ: local {lnames}, mount {mnames}")
        for name in set(lnames) & set(mnames):
            a = read_all(os.path.join(local_root, tag, name))
            b = read_all(os.path.join(mount_root, tag, name))
            if a != b:
                problems.append(f"{tag}/{name}: {len(a)} bytes locally, {len(b)} through the "
                                "mount, contents differ")
        view = read_all(os.path.join(local_root, tag, f"{tag}.bin"))
        chunk_names = {n for n in os.listdir(os.path.join(mount_root, tag))
                       if n.startswith("chunk_")}
        for i in range(-(-len(view) // cs)):
            if f"chunk_{i}" not in chunk_names:
                problems.append(f"{tag}: chunk_{i} is not listed")
                continue
            got = read_all(os.path.join(mount_root, tag, f"chunk_{i}"))
            if got != view[i * cs:(i + 1) * cs].ljust(cs, b"\0"):
                problems.append(f"{tag}: chunk_{i} differs from the view")
    return problems


def run_case(run: Run, budget: Budget, res: CaseResult) -> None:
    seeds = [run.seed * 100 + 1] if run.quick else [run.seed * 100 + k for k in (1, 2, 3)]
    steps = 400 if run.quick else 2000
    chunk_sizes = {tag: cs for tag, _, cs in TAGS}
    differing: list[str] = []
    for seed in seeds:
        if budget.over():
            res.out_of_time(res.trials, len(seeds), "scripts")
            break
        local_root = run.fresh_dir("fsrand-local")
        srcs = []
        for k, (tag, size, _) in enumerate(TAGS):
            os.makedirs(os.path.join(local_root, tag))
            src, data = run.make_source(f"{tag}.bin", size, seed=seed * 10 + k,
                                        directory=run.fresh_dir("fsrand-src"))
            with open(os.path.join(local_root, tag, f"{tag}.bin"), "wb") as f:
                f.write(data)
            srcs.append(src)
        store = run.fresh_dir("fsrand-store")
        m = None
        for k, (_tag, _, cs) in enumerate(TAGS):  # one mount per tag's chunk size, same store
            if m is not None:
                m.umount()
            m = run.mount(srcs[k], store=store, args=["--chunk-size", str(cs)])
        assert m is not None
        m.umount()
        m = run.mount(store=store)  # every tag of the store
        rng = random.Random(f"fsrand:{seed}")
        local, mount = Side(local_root), Side(m.path)
        try:
            for _ in range(steps):
                what, a, b = step(rng, local, mount, chunk_sizes)
                res.operations += 1
                if a != b:
                    differing.append(f"seed {seed}: {what}: local {_short(a)}, "
                                     f"mount {_short(b)}")
        finally:
            local.close()
            mount.close()
        problems = compare_trees(local_root, m.path, chunk_sizes)
        m.umount()
        m = run.mount(store=store)
        problems += [f"after the remount: {p}" for p in
                     compare_trees(local_root, m.path, chunk_sizes)]
        m.umount()
        differing.extend(f"seed {seed}: {p}" for p in problems)
        res.trials += 1
    res.check(not differing, f"{res.operations} operations with the same outcome on both "
              "sides; the trees equal byte for byte, also after a remount",
              f"{len(differing)} differences: " + "; ".join(differing[:3]))
    res.notes.extend(differing[:40])


def _short(outcome: object) -> str:
    kind, value = outcome  # type: ignore[misc]
    if isinstance(value, bytes):
        return f"{len(value)} bytes"
    return f"{kind} {value}"
