"""crossname_tools: fsx- and fio-style verify runs through a tag's view and a user blob, then
the same bytes verified again after an unmount and a remount.

Run through ``scripts/crossname_tools`` (which installs Debian's fio and the venv first). The
full run's companion to the ``crossname`` torture case (docs/reliability.md); not run by CI.

- ``fsxcheck`` (``faultfs.testing.fsxcheck``, our own checker of fsx's kind) on the whole-object
  view and on a user blob: random reads, writes, truncates, map reads and writes, fsyncs and
  reopens, every read checked against a model; the model kept to compare after the remount.
- fio with ``--verify=crc32c``: random writes of several block sizes (unaligned 100 and 1000
  bytes, 4 KiB, 64 KiB) through the ``psync``, ``mmap`` and ``io_uring`` engines into the
  view of a tag of its own (over the source's bytes) and into a user blob, each verified after
  its writes (``do_verify``) and again, with ``--verify_only``, after the remount.

Each step has a time bound; the mount is taken down whatever happens (a connection that does
not answer is aborted). One line per step and a verdict; exit 1 when anything failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from faultfs.testing.torture.harness import MiB, Run, TortureError

STEP_TIMEOUT_S = 900
FIO_SIZES = ("100", "1000", "4k", "64k")
FIO_ENGINES = ("psync", "mmap", "io_uring")


def fio_job(name: str, path: str, *, offset: int, size: int, bs: str, engine: str,
            seed: int, verify_only: bool = False) -> list[str]:
    block = int(bs[:-1]) * 1024 if bs.endswith("k") else int(bs)
    size -= size % block  # whole blocks: a file shorter than --size is laid out (emptied) again
    cmd = ["fio", f"--name={name}", f"--filename={path}", f"--offset={offset}", f"--size={size}",
           "--rw=randwrite", f"--bs={bs}", f"--ioengine={engine}", "--verify=crc32c",
           "--do_verify=1", "--verify_fatal=1", "--verify_dump=0", f"--randseed={seed}",
           "--group_reporting=1", "--output-format=terse", "--fallocate=none",
           "--verify_state_save=0"]
    if engine == "io_uring":
        cmd.append("--iodepth=8")
    if verify_only:
        cmd.append("--verify_only=1")
    return cmd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/crossname_tools", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer ops and smaller fio regions")
    p.add_argument("--fsx-ops", type=int, default=None, help="ops per fsxcheck run")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    fsx_ops = args.fsx_ops or (3000 if args.quick else 30000)
    region = (1 if args.quick else 4) * MiB  # per fio job
    run = Run(quick=args.quick)
    rows: list[tuple[str, str, float]] = []
    failed = False

    def step(what: str, cmd: list[str], env: dict | None = None) -> bool:
        nonlocal failed
        t0 = time.monotonic()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=STEP_TIMEOUT_S,
                               env=env, stdin=subprocess.DEVNULL, cwd=run.root)
            ok = r.returncode == 0
            out = (r.stdout + r.stderr).strip()
        except subprocess.TimeoutExpired:
            ok, out = False, f"did not finish in {STEP_TIMEOUT_S} s"
        took = time.monotonic() - t0
        if ok and cmd[0] == "fio":
            out = "verified"
        line = out.splitlines()[-1] if ok and out else out[-1500:]
        rows.append((what, ("ok: " if ok else "FAILED: ") + line, took))
        print(f"[{took:6.1f} s] {what}: {'ok' if ok else 'FAILED'}", file=sys.stderr, flush=True)
        if not ok:
            print(out[-3000:], file=sys.stderr)
            failed = True
        return ok

    try:
        src, _ = run.make_source("tools.bin", 64 * MiB, seed=args.seed)
        # fio's mmap engine maps from the start of the file whatever --offset says (fio 3.33):
        # each fio job on a view gets a tag of its own and writes it from its start
        jobs = [(engine, bs) for engine in FIO_ENGINES for bs in FIO_SIZES]
        views = [run.make_source(f"fio-{e}-{bs}.bin", region, seed=args.seed + 1 + i)[0]
                 for i, (e, bs) in enumerate(jobs)]
        store = run.fresh_dir("tools-store")
        m = run.mount(src, *views, store=store, args=["--chunk-size", "1M"])
        tag = m.tag("tools")
        models = run.fresh_dir("tools-models")
        py = [sys.executable, "-m", "faultfs.testing.fsxcheck"]
        user = os.path.join(tag, "fsx-user.dat")
        step("create a user blob of 1 MiB",  # fsxcheck takes the file as it is
             [sys.executable, "-c", "import os, sys; open(sys.argv[1], 'wb').write("
              "os.urandom(1 << 20))", user])
        fsx = [("the view", os.path.join(tag, "tools.bin"), ["--max-size", str(80 * MiB)]),
               ("a user blob", user, ["--max-size", str(8 * MiB)])]
        for what, path, extra in fsx:
            step(f"fsxcheck {fsx_ops} ops on {what}",
                 [*py, path, "--ops", str(fsx_ops), "--seed", str(args.seed), *extra,
                  "--model-out", os.path.join(models, os.path.basename(path))])
        fio = []
        for engine, bs in jobs:
            name = f"fio-{engine}-{bs}"
            fio.append((f"fio {engine} {bs} on the view", m.tag(name), f"{name}.bin"))
            fio.append((f"fio {engine} {bs} on a user blob", tag, f"{name}.dat"))
        for i, (what, directory, file) in enumerate(fio):
            engine, bs = file[:-4].split("-")[1:]
            step(what, fio_job(file, os.path.join(directory, file), offset=0, size=region,
                               bs=bs, engine=engine, seed=args.seed + i))
        m.umount()
        m = run.mount(store=store, mountpoint=m.path)
        for _, path, _ in fsx:
            step(f"after the remount: {os.path.basename(path)} as fsxcheck left it",
                 ["cmp", path, os.path.join(models, os.path.basename(path))])
        for i, (what, directory, file) in enumerate(fio):
            engine, bs = file[:-4].split("-")[1:]
            step(f"after the remount: {what} (verify_only)",
                 fio_job(file, os.path.join(directory, file), offset=0, size=region, bs=bs,
                         engine=engine, seed=args.seed + i, verify_only=True))
        m.umount()
    except (TortureError, OSError, subprocess.SubprocessError) as exc:
        rows.append(("the run", f"FAILED: {type(exc).__name__}: {exc}", 0.0))
        failed = True
    except KeyboardInterrupt:
        rows.append(("the run", "interrupted", 0.0))
        failed = True
    finally:
        leftovers = run.cleanup()
    width = max(len(r[0]) for r in rows) if rows else 10
    for what, verdict, took in rows:
        print(f"{what.ljust(width)}  {took:6.1f} s  {verdict}")
    for item in leftovers:
        print(f"cleanup: {item}")
    print("FAILED" if failed or leftovers else "all held")
    return 1 if failed or leftovers else 0


if __name__ == "__main__":
    sys.exit(main())
