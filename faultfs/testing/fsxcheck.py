"""A checker of fsx's kind, written here (none of fsx's code): a seeded stream of random reads,
writes, truncates, reads and writes through a shared map, fsyncs and reopens against one file,
every read (and the size after every op) compared with an in-memory model of the file; the
first difference stops it with the ops that led there.

    python -m faultfs.testing.fsxcheck FILE [--ops N] [--seed S] [--max-size BYTES]
                                            [--no-mmap] [--no-truncate] [--model-out PATH]

The file is taken as it is (its bytes are the model's start); a file that cannot change size
(``chunk_N``) wants ``--no-truncate`` and ``--max-size`` at most its size. ``--model-out``
writes the expected bytes at the end, to compare with the file after a remount (``cmp``).
Exit status: 0 when every check held, 1 at the first difference, 2 for an error of the file
system (an op that failed).
"""

from __future__ import annotations

import argparse
import collections
import errno
import mmap
import os
import random
import sys
import time

OPS = ("read", "write", "truncate", "mapread", "mapwrite", "fsync", "reopen")
WEIGHTS = (30, 30, 8, 12, 12, 4, 4)


class Mismatch(Exception):
    pass


class Checker:
    def __init__(self, path: str, *, seed: int, max_size: int, use_mmap: bool,
                 truncate: bool, max_io: int) -> None:
        self.path = path
        self.rng = random.Random(f"fsxcheck:{seed}")
        self.max_size = max_size
        self.use_mmap = use_mmap
        self.truncate = truncate
        self.max_io = max_io
        self.fd = os.open(path, os.O_RDWR)
        with open(path, "rb") as f:
            self.model = bytearray(f.read())
        self.history: collections.deque[str] = collections.deque(maxlen=24)
        self.counts = collections.Counter()

    # -- ops ----------------------------------------------------------------------------------

    def _span(self, limit: int) -> tuple[int, int]:
        """An offset and a length: small and unaligned mostly, sometimes page-aligned."""
        if self.rng.random() < 0.3:
            page = mmap.PAGESIZE
            off = self.rng.randrange(0, max(1, limit // page)) * page
            n = self.rng.randrange(1, max(2, self.max_io // page)) * page
        else:
            off = self.rng.randrange(0, max(1, limit))
            n = self.rng.randrange(1, self.max_io + 1)
        return off, n

    def _compare(self, what: str, got: bytes, off: int) -> None:
        want = bytes(self.model[off:off + len(got)])
        if got != want:
            first = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b) \
                if len(got) == len(want) else min(len(got), len(want))
            raise Mismatch(f"{what}: {sum(a != b for a, b in zip(got, want, strict=False))} "
                           f"of {len(got)} bytes differ, the first at file offset "
                           f"{off + first} (got {got[first:first + 8].hex()}, expected "
                           f"{want[first:first + 8].hex()})")

    def op_read(self) -> str:
        off, n = self._span(len(self.model) + self.max_io // 4)
        got = os.pread(self.fd, n, off)
        expect = max(0, min(n, len(self.model) - off))
        what = f"read [{off}, +{n})"
        if len(got) != expect:
            raise Mismatch(f"{what}: {len(got)} bytes, expected {expect} (size "
                           f"{len(self.model)})")
        self._compare(what, got, off)
        return what

    def op_write(self) -> str:
        off, n = self._span(min(self.max_size, len(self.model) + self.max_io))
        n = min(n, self.max_size - off)
        if n <= 0:
            return self.op_read()
        data = self.rng.randbytes(n)
        done = os.pwrite(self.fd, data, off)
        if done != n:
            raise Mismatch(f"write [{off}, +{n}): {done} bytes written")
        if off > len(self.model):
            self.model.extend(bytes(off - len(self.model)))
        self.model[off:off + n] = data
        return f"write [{off}, +{n})"

    def op_truncate(self) -> str:
        if not self.truncate:
            return self.op_write()
        size = self.rng.randrange(0, self.max_size + 1)
        os.ftruncate(self.fd, size)
        if size < len(self.model):
            del self.model[size:]
        else:
            self.model.extend(bytes(size - len(self.model)))
        return f"truncate to {size}"

    def op_mapread(self) -> str:
        if not self.use_mmap or not self.model:
            return self.op_read()
        size = len(self.model)
        off, n = self._span(size)
        n = min(n, size - off)
        with mmap.mmap(self.fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as m:
            got = m[off:off + n]
        what = f"map read [{off}, +{n})"
        self._compare(what, got, off)
        return what

    def op_mapwrite(self) -> str:
        if not self.use_mmap or not self.model:
            return self.op_write()
        size = len(self.model)
        off, n = self._span(size)
        n = min(n, size - off)
        data = self.rng.randbytes(n)
        with mmap.mmap(self.fd, size) as m:
            m[off:off + n] = data
            m.flush()  # msync(MS_SYNC)
        self.model[off:off + n] = data
        return f"map write [{off}, +{n})"

    def op_fsync(self) -> str:
        os.fsync(self.fd)
        return "fsync"

    def op_reopen(self) -> str:
        os.close(self.fd)
        self.fd = os.open(self.path, os.O_RDWR)
        return "close and reopen"

    # -- the run ----------------------------------------------------------------------------

    def step(self, k: int) -> None:
        op = self.rng.choices(OPS, WEIGHTS)[0]
        what = getattr(self, f"op_{op}")()
        self.counts[op] += 1
        self.history.append(f"#{k} {what}")
        size = os.fstat(self.fd).st_size
        if size != len(self.model):
            raise Mismatch(f"after {what}: the file is {size} bytes, expected "
                           f"{len(self.model)}")

    def final(self) -> None:
        with open(self.path, "rb") as f:
            got = f.read()
        self.history.append("read the whole file")
        if len(got) != len(self.model):
            raise Mismatch(f"the whole file: {len(got)} bytes, expected {len(self.model)}")
        self._compare("the whole file", got, 0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m faultfs.testing.fsxcheck",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--ops", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-size", type=int, default=4 << 20)
    p.add_argument("--max-io", type=int, default=64 << 10, help="largest read or write")
    p.add_argument("--no-mmap", action="store_true")
    p.add_argument("--no-truncate", action="store_true")
    p.add_argument("--model-out", help="write the expected bytes here at the end")
    args = p.parse_args(argv)
    c = Checker(args.file, seed=args.seed, max_size=args.max_size, use_mmap=not args.no_mmap,
                truncate=not args.no_truncate, max_io=args.max_io)
    started = time.monotonic()
    k = 0
    try:
        for k in range(args.ops):
            c.step(k)
        c.final()
    except Mismatch as exc:
        print(f"fsxcheck {args.file}: MISMATCH at op {k} of {args.ops} (seed {args.seed}): "
              f"{exc}\nthe ops before it:\n  " + "\n  ".join(c.history), file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"fsxcheck {args.file}: op {k} failed: "
              f"{errno.errorcode.get(exc.errno or 0, exc.errno)}: {exc}\nthe ops before it:\n  "
              + "\n  ".join(c.history), file=sys.stderr)
        return 2
    if args.model_out:
        with open(args.model_out, "wb") as f:
            f.write(c.model)
    counts = ", ".join(f"{n} {op}" for op, n in sorted(c.counts.items()))
    print(f"fsxcheck {args.file}: {args.ops} ops held in {time.monotonic() - started:.1f} s "
          f"(seed {args.seed}; {counts}); {len(c.model)} bytes at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
