"""bench_fsspec: faultfs:: against fsspec's own caches (blockcache::, simplecache::) and plain
s3fs, all reading one S3 object through a latency proxy, in one run (DESIGN §18, issue 47).

One S3 endpoint on 127.0.0.1 (s3rver, or moto when node/npm are missing), reached through
faultfs.testing.proxy.LatencyProxy in a process of its own (--latency-ms before each
response's first byte, --conn-mbps per connection). Every case runs in fresh reader
processes (nothing of a previous case in their memory) with a fresh cache directory, --runs
times (medians reported); the systems take turns within each case of a run:
- seq: one sequential read of the whole --size-mb object with 1 MiB reads (open included);
- rand4k1 / rand4k8 / rand64k1 / rand64k8: --rand-ops reads of 4 KiB or 64 KiB at random
  aligned offsets, in 1 process or 8 processes at once on one cache directory (ops/s);
- h5py: h5py.File(fs.open(...)) reads a whole chunked, gzip-compressed dataset (--h5-mb);
- ncopen: xarray.open_dataset(fs.open(...), engine="h5netcdf") of a NetCDF-4 object of
  --nc-vars variables of 4 MiB (every variable's header read), the first variable read;
- each again warm: the same case in new processes over the cache directory the cold case left;
- shared8: 8 processes read the whole object at once through one cache directory: the bytes
  the proxy served, over the object's size.
Each system with its defaults: faultfs:: (4 MiB chunks, read-ahead 4; 8 processes share one
store; pin_ttl 60 s, its default: an object pinned in the last minute by any process opens
without asking S3), faultfs-ttl0 (the same with pin_ttl=0: every open pins the object with a
HEAD, the behaviour before the ttl), blockcache:: and simplecache:: over s3fs (8 processes: a cache directory each — one
shared by 8 readers gave simplecache:: wrong bytes), plain s3fs (50 MiB readahead blocks), and
local: the object's bytes in a local file read with open() — the floor of any cache's warm
pass (its "cold" rows read the same file). Every read is checked against the object. The
readers of a case start together once all have imported their modules and made their file
system (a barrier); each reports the wall time and the CPU time of its timed part. The results section of docs/benchmarks-fsspec.md is rewritten (--no-doc to skip).
--quick: a 64 MiB object, 48 random reads per process, one run (a test may call it).
--variant NAME=DIR: another tree's faultfs:: beside, as system faultfs-NAME (a before/after
in one run). Each case's log line has the GETs and MiB the proxy served, the readers' open
time and read latencies, and faultfs::'s counters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import (
    S3_KEY_ID,
    S3_REGION,
    S3_SECRET,
    aws_env,
    ensure_bucket,
    log,
    s3_client,
    start_s3_server,
    stop_process,
)

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks-fsspec.md"
BEGIN, END = "<!-- bench_fsspec results: begin -->", "<!-- bench_fsspec results: end -->"
BUCKET, KEY, H5_KEY = "faultfs-bench", "run42/field.bin", "run42/chunks.h5"
NC_KEY = "run42/vars.nc"  # the ncopen case's NetCDF-4 object
SYSTEMS = ("faultfs", "faultfs-ttl0", "blockcache", "simplecache", "s3fs", "local")
LOCAL_FILES: dict[str, str] = {}  # system "local": each key's bytes in a local file
OURS = ("faultfs", "faultfs-ttl0")
VARIANTS: dict[str, str] = {}  # faultfs-NAME: the tree its readers import (--variant)


def ours(system: str) -> bool:
    return system in OURS or system in VARIANTS
CASES = ("seq", "rand4k1", "rand4k8", "rand64k1", "rand64k8", "h5py", "ncopen")
RANDOM = {"rand4k1": (4096, 1), "rand4k8": (4096, 8), "rand64k1": (65536, 1),
          "rand64k8": (65536, 8)}
CASE_TIMEOUT_S = 600.0
WHO = "bench_fsspec"

# One reader process: open the object through one system and run one case; prints JSON.
READER = r"""
import hashlib, json, random, sys, time
import fsspec
system, endpoint, cache, case, key, size, n, ops, seed = sys.argv[1:10]
size, n, ops, seed = int(size), int(n), int(ops), int(seed)
s3 = {"endpoint_url": endpoint, "key": sys.argv[10], "secret": sys.argv[11],
      "client_kwargs": {"region_name": sys.argv[12]}, "use_listings_cache": False}
if case == "h5py":
    import h5py
if case == "ncopen":
    import xarray as xr
if system.startswith("faultfs"):
    fs = fsspec.filesystem("faultfs", target_protocol="s3", target_options=s3, store=cache,
                           reserve_mb=0, **({"pin_ttl": 0} if system == "faultfs-ttl0" else {}))
elif system in ("blockcache", "simplecache"):
    fs = fsspec.filesystem(system, target_protocol="s3", target_options=s3,
                           cache_storage=cache)
elif system == "local":  # the floor of any cache: the object's bytes in a local file (key)
    class _Local:
        open = staticmethod(lambda path, mode: open(path, mode))
    fs = _Local()
else:
    fs = fsspec.filesystem("s3", **s3)
print("ready", flush=True)  # the barrier: every reader is up before any starts
sys.stdin.readline()
began, cpu = time.perf_counter(), time.process_time()
out = {}
# the bytes read are checked after the timed part (a sha256 of 64 MiB took longer than a
# warm cache's whole read of them)
if case in ("seq", "shared8"):
    blocks, lat = [], []
    with fs.open(key, "rb") as f:
        out["open"] = time.perf_counter() - began
        while True:
            t0 = time.perf_counter()
            block = f.read(1 << 20)
            lat.append(time.perf_counter() - t0)
            if not block:
                break
            blocks.append(block)
elif case == "h5py":
    with fs.open(key, "rb") as f, h5py.File(f, "r") as h5:
        data = h5["field"][...]
elif case == "ncopen":  # xarray opens a NetCDF-4 file: every variable's header, one read
    with fs.open(key, "rb") as f, xr.open_dataset(f, engine="h5netcdf") as ds:
        names = sorted(ds.data_vars)
        data = ds[names[0]].values
else:
    rng = random.Random(seed)
    pieces, lat = [], []
    with fs.open(key, "rb") as f:
        out["open"] = time.perf_counter() - began
        for _ in range(ops):
            off = rng.randrange(0, size // n) * n
            t0 = time.perf_counter()
            f.seek(off)
            pieces.append((off, f.read(n)))
            lat.append(time.perf_counter() - t0)
out["seconds"] = time.perf_counter() - began
out["cpu"] = time.process_time() - cpu  # all of the process's threads
if case in ("seq", "shared8"):
    h = hashlib.sha256()
    for block in blocks:
        h.update(block)
    out["lat"], out["sha"] = lat, h.hexdigest()
elif case == "h5py":
    out["sum"] = float(data.sum(dtype="f8"))
elif case == "ncopen":
    out["sum"] = [len(names), float(data.sum(dtype="f8"))]
else:
    out["lat"] = lat
    out["got"] = [(off, hashlib.sha256(piece).hexdigest()) for off, piece in pieces]
if system.startswith("faultfs"):
    fs.drain(30)
    out["stats"] = fs.stats()
print(json.dumps(out))
"""

PROXY = r"""
import json, sys
from faultfs.testing.proxy import LatencyProxy
host, port, delay, conn = sys.argv[1:]
proxy = LatencyProxy(host, int(port), delay_ms=float(delay), conn_mbps=float(conn) or None,
                     lifetime_s=6 * 3600, max_connections=512, idle_timeout_s=120)
with proxy:
    print(proxy.url, flush=True)
    for _ in sys.stdin:
        s = proxy.stats(log=True)
        proxy.reset_stats()
        gets = [r for r in s["log"] if r["method"] == "GET"]
        print(json.dumps({"gets": len(gets),
                          "heads": sum(r["method"] == "HEAD" for r in s["log"]),
                          "get_bytes": sum(r["response_bytes"] for r in gets)}), flush=True)
"""


class Proxy:
    def __init__(self, upstream: str, delay_ms: float, conn_mbps: float, work: Path) -> None:
        host, _, port = upstream.removeprefix("http://").partition(":")
        with open(work / "proxy.log", "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", PROXY, host, port, str(delay_ms), str(conn_mbps)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                cwd=ROOT, start_new_session=True)
        assert self.proc.stdout is not None
        self.url = self.proc.stdout.readline().strip()
        if not self.url.startswith("http://"):
            raise SystemExit(f"{WHO}: the proxy did not start (see {work}/proxy.log)")

    def window(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        stop_process(self.proc)


def readers(system: str, proxy: Proxy, cache: Path, case: str, key: str, size: int, n: int,
            ops: int, procs: int, env: dict) -> list[dict]:
    """``procs`` reader processes of one case, started together; their JSON answers."""
    # fsspec's caches are not safe for processes sharing a directory (simplecache:: served
    # wrong bytes to 8 readers of one directory here): each process gets its own, as a
    # careful user must; faultfs:: processes share one store, as they are meant to
    dirs = [cache if ours(system) or procs == 1 else cache / str(i) for i in range(procs)]
    if ours(system):  # this tree's faultfs, or a variant's (--variant NAME=DIR)
        env = dict(env, PYTHONPATH=VARIANTS.get(system, str(ROOT)))
    for d in dirs:
        d.mkdir(exist_ok=True)
    children = [subprocess.Popen(
        [sys.executable, "-c", READER, system, proxy.url, str(dirs[i]), case,
         LOCAL_FILES[key] if system == "local" else f"{BUCKET}/{key}", str(size), str(n), str(ops), str(1000 + i),
         S3_KEY_ID, S3_SECRET, S3_REGION],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env, cwd="/")
        for i in range(procs)]
    # a barrier: every reader has imported its modules and made its file system before any
    # starts (a reader still importing would take the cores from the others' timed reads)
    for child in children:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "ready":
            _, stderr = child.communicate(timeout=CASE_TIMEOUT_S)
            raise SystemExit(f"{WHO}: {system} {case} failed: {stderr.strip()[-800:]}")
    for child in children:
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
    out = []
    for child in children:
        stdout, stderr = child.communicate(timeout=CASE_TIMEOUT_S)
        if child.returncode != 0:
            raise SystemExit(f"{WHO}: {system} {case} failed: {stderr.strip()[-800:]}")
        out.append(json.loads(stdout))
    return out


def where_time_went(answers: list[dict], served: dict) -> str:
    """The per-run line's detail: GETs and MiB the proxy served, the readers' open and read
    latencies (random cases: median, p90, max in ms), and faultfs::'s counters."""
    out = (f"; {served['gets']} GETs, {served['get_bytes'] / 2**20:.1f} MiB, "
           f"{served['heads']} HEADs")
    out += f"; cpu {statistics.median(a['cpu'] for a in answers) * 1e3:.1f} ms/proc"
    lat = sorted(x for a in answers for x in a.get("lat", ()))
    if lat:
        opened = statistics.median(a["open"] for a in answers)
        out += (f"; open {opened * 1e3:.0f} ms, reads p50/p90/max "
                f"{lat[len(lat) // 2] * 1e3:.1f}/{lat[len(lat) * 9 // 10] * 1e3:.1f}/"
                f"{lat[-1] * 1e3:.1f} ms, sum {sum(lat) / len(answers) * 1e3:.0f} ms/proc")
    stats: dict[str, int] = {}
    for a in answers:
        for k, v in a.get("stats", {}).items():
            stats[k] = stats.get(k, 0) + v
    keep = ("faults", "source_reads", "hits", "joined", "memory_hits", "claim_waits",
            "head_reads", "split_faults", "stored")
    shown = [f"{k}={stats[k]}" for k in keep if stats.get(k)]
    return out + ("; " + " ".join(shown) if shown else "")


def check(case: str, answers: list[dict], expect: dict) -> None:
    for answer in answers:
        if case in ("seq", "shared8"):
            assert answer["sha"] == expect["sha"], f"{case}: wrong bytes"
        elif case == "h5py":
            assert answer["sum"] == expect["h5sum"], f"{case}: wrong values"
        elif case == "ncopen":
            assert answer["sum"] == expect["ncsum"], f"{case}: wrong values"
        else:
            for off, digest in answer["got"]:
                assert digest == expect["pieces"][(off, RANDOM[case][0])], f"{case}: wrong bytes"


def measure(args, proxy: Proxy, work: Path, env: dict, expect: dict) -> dict:
    """results[(system, case, warm)] = list of values (seconds, or ops/s for random cases)."""
    results: dict[tuple[str, str, bool], list[float]] = {}
    source: dict[tuple[str, str, bool], list[int]] = {}
    cpu: dict[tuple[str, str, bool], list[float]] = {}  # a reader's CPU seconds (median)
    for run in range(args.runs):
        for case in args.cases:  # the systems of one case run back to back: a load that
            # comes and goes on a shared machine weighs on the ratios less
            for system in args.systems[run % len(args.systems):] + args.systems[:run % len(
                    args.systems)]:
                cache = work / f"cache-{system}-{case}-{run}"
                cache.mkdir()
                key = {"h5py": H5_KEY, "ncopen": NC_KEY}.get(case, KEY)
                size = expect.get(f"{case}size", args.size_mb << 20)
                n, procs = RANDOM.get(case, (0, 1))
                for warm in (False, True):
                    proxy.window()
                    answers = readers(system, proxy, cache, case, key, size, n, args.rand_ops,
                                      procs, env)
                    check(case, answers, expect)
                    took = max(a["seconds"] for a in answers)
                    value = (args.rand_ops * procs / took) if case in RANDOM else took
                    results.setdefault((system, case, warm), []).append(value)
                    cpu.setdefault((system, case, warm), []).append(
                        statistics.median(a["cpu"] for a in answers))
                    served = proxy.window()
                    source.setdefault((system, case, warm), []).append(served["get_bytes"])
                    log(f"run {run + 1} {system:11s} {case:8s} {'warm' if warm else 'cold'}: "
                        f"{value:9.2f} {'ops/s' if case in RANDOM else 's'}"
                        f"{where_time_went(answers, served)}", WHO)
                shutil.rmtree(cache, ignore_errors=True)
    shared = []
    for run in range(args.runs):
        cache = work / f"cache-shared8-{run}"
        cache.mkdir()
        proxy.window()
        answers = readers("faultfs", proxy, cache, "shared8", KEY, args.size_mb << 20, 0, 0, 8,
                          env)
        check("shared8", answers, expect)
        shared.append(proxy.window()["get_bytes"] / (args.size_mb << 20))
        shutil.rmtree(cache, ignore_errors=True)
    return {"results": results, "source": source, "cpu": cpu, "shared8": shared}


def render(args, measured: dict, meta: dict) -> str:
    res = measured["results"]
    med = {k: statistics.median(v) for k, v in res.items()}
    lines = [BEGIN, "",
             f"Run {meta['when']} on {meta['machine']}: {meta['server']} through the latency "
             f"proxy ({args.latency_ms:g} ms before each response, {args.conn_mbps:g} MB/s per "
             f"connection); object {args.size_mb} MiB, HDF5 dataset {args.h5_mb} MiB "
             f"(gzip-compressed, {meta['h5size'] >> 20} MiB stored); {args.rand_ops} random "
             f"reads per process; {args.runs} run(s), medians"
             + (" (--quick)" if args.quick else "") + ".", "",
             "Seconds (seq, h5py; lower is better) or reads per second (random; higher is "
             "better), cold (empty cache directory) and warm (new processes over the cache "
             "the cold case left):", "",
             "| case | " + " | ".join(args.systems) + " |",
             "| --- |" + " ---: |" * len(args.systems)]
    for case in args.cases:
        for warm in (False, True):
            unit = "ops/s" if case in RANDOM else "s"
            cells = [f"{med[(s, case, warm)]:.2f}" for s in args.systems]
            lines.append(f"| {case} {'warm' if warm else 'cold'} ({unit}) | "
                         + " | ".join(cells) + " |")
    others = [s for s in args.systems if not ours(s)]
    for mine in [s for s in args.systems if ours(s)]:
        if not others:
            break
        lines += ["", f"{mine} against each (speed-up: >1 means it is faster; target ≥ 1.5 "
                  "cold, ≥ 2 warm):", "",
                  "| case | " + " | ".join(f"vs {s}" for s in others) + " |",
                  "| --- |" + " ---: |" * len(others)]
        for case in args.cases:
            for warm in (False, True):
                cells = []
                for s in others:
                    if s == "local" and not warm:
                        cells.append("—")  # a local file is never cold: no target
                        continue
                    value, theirs = med[(mine, case, warm)], med[(s, case, warm)]
                    ratio = value / theirs if case in RANDOM else theirs / value
                    target = 2.0 if warm else 1.5
                    cells.append(f"{ratio:.2f}×" + ("" if ratio >= target else " (below)"))
                lines.append(f"| {case} {'warm' if warm else 'cold'} | " + " | ".join(cells)
                             + " |")
    cpu = {k: statistics.median(v) for k, v in measured["cpu"].items()}
    lines += ["", "CPU milliseconds of one reader process (the timed part, all its threads; "
              "median of the processes, then of the runs) — what a loaded machine moves less:",
              "", "| case | " + " | ".join(args.systems) + " |",
              "| --- |" + " ---: |" * len(args.systems)]
    for case in args.cases:
        for warm in (False, True):
            cells = [f"{cpu[(s, case, warm)] * 1e3:.2f}" for s in args.systems]
            lines.append(f"| {case} {'warm' if warm else 'cold'} | " + " | ".join(cells) + " |")
    src = {k: statistics.median(v) for k, v in measured["source"].items()}
    lines += ["", "Bytes the proxy served per case, over the object (cold / warm):", "",
              "| case | " + " | ".join(args.systems) + " |",
              "| --- |" + " ---: |" * len(args.systems)]
    for case in args.cases:
        total = meta.get(f"{case}size", args.size_mb << 20)
        cells = [f"{src[(s, case, False)] / total:.2f} / {src[(s, case, True)] / total:.2f}"
                 for s in args.systems]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    lines += ["", f"8 processes reading the whole object at once through one faultfs:: store: "
              f"the source served {statistics.median(measured['shared8']):.3f}× the object "
              f"(target ≤ 1.05×; runs: "
              + ", ".join(f"{x:.3f}" for x in measured["shared8"]) + ").", "", END]
    return "\n".join(lines)


def h5_object(path: Path, mib: int) -> float:
    import h5py
    import numpy

    rng = numpy.random.default_rng(4)
    n = (mib << 20) // 4
    data = (rng.standard_normal(n).astype("f4") * 100).round(1)  # compressible, like a field
    with h5py.File(path, "w") as f:
        f.create_dataset("field", data=data, chunks=(1 << 18,), compression="gzip",
                         compression_opts=4)
    return float(data.sum(dtype="f8"))


def nc_object(path: Path, variables: int) -> list:
    """A NetCDF-4 file as xarray writes it (links in a fractal heap; each variable's header
    beside its 4 MiB of data); what ncopen reads of it: [variables, the first one's sum]."""
    import numpy
    import xarray

    rng = numpy.random.default_rng(5)
    names = [f"v{i:04d}" for i in range(variables)]
    ds = xarray.Dataset({name: (("x",), rng.standard_normal(1 << 20).astype("f4").round(2))
                         for name in names})
    ds.to_netcdf(path, engine="h5netcdf")
    return [variables, float(ds[names[0]].values.sum(dtype="f8"))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="a 64 MiB object, 48 random reads per process, one run")
    parser.add_argument("--size-mb", type=int, default=256, help="object size in MiB (256)")
    parser.add_argument("--h5-mb", type=int, default=64, help="HDF5 dataset MiB (64)")
    parser.add_argument("--nc-vars", type=int, default=100,
                        help="variables of 4 MiB in the NetCDF-4 object ncopen opens (100)")
    parser.add_argument("--runs", type=int, help="repetitions (3; --quick: 1)")
    parser.add_argument("--rand-ops", type=int, default=200, help="random reads per process")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--conn-mbps", type=float, default=100.0)
    parser.add_argument("--server", choices=("s3rver", "moto"), default="s3rver")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=DIR",
                        help="also run faultfs:: from another tree as system faultfs-NAME "
                        "(its readers import DIR: a before/after in one run)")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "faultfs-bench"))
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.size_mb, args.h5_mb, args.rand_ops, args.nc_vars = 64, 16, 48, 16
    args.runs = args.runs or (1 if args.quick else 3)
    args.systems = [s for s in args.systems.split(",") if s]
    for variant in args.variant:
        name, _, tree = variant.partition("=")
        if not name or not os.path.isdir(os.path.join(tree, "faultfs")):
            parser.error(f"--variant {variant!r}: NAME=DIR, DIR a faultfs tree")
        VARIANTS[f"faultfs-{name}"] = os.path.abspath(tree)
        if f"faultfs-{name}" not in args.systems:
            args.systems.insert(1, f"faultfs-{name}")
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(args.systems) - set(SYSTEMS) - set(VARIANTS)) + sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown system or case: {', '.join(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="bench-fsspec-"))
    env = aws_env(work)
    server = proxy = None
    try:
        endpoint, what, server = start_s3_server(args.server, work, Path(args.cache), BUCKET,
                                                 WHO)
        client = s3_client(endpoint)
        ensure_bucket(client, BUCKET)
        rng = random.Random(1)  # in pieces: one randbytes call holds 256 MiB at most
        data = b"".join(rng.randbytes(min(64, args.size_mb - at) << 20)
                        for at in range(0, args.size_mb, 64))
        client.put_object(Bucket=BUCKET, Key=KEY, Body=data)
        h5 = work / "chunks.h5"
        h5sum = h5_object(h5, args.h5_mb)
        client.upload_file(str(h5), BUCKET, H5_KEY)
        nc, ncsum = work / "vars.nc", None
        if "ncopen" in args.cases:
            ncsum = nc_object(nc, args.nc_vars)
            client.upload_file(str(nc), BUCKET, NC_KEY)
        if "local" in args.systems:
            (work / "object.bin").write_bytes(data)
            LOCAL_FILES.update({KEY: str(work / "object.bin"), H5_KEY: str(h5), NC_KEY: str(nc)})
        import hashlib

        pieces = {}
        for n, procs in RANDOM.values():
            for i in range(procs):
                rng = random.Random(1000 + i)
                for _ in range(args.rand_ops):
                    off = rng.randrange(0, (args.size_mb << 20) // n) * n
                    pieces[(off, n)] = hashlib.sha256(data[off:off + n]).hexdigest()
        expect = {"sha": hashlib.sha256(data).hexdigest(), "h5sum": h5sum,
                  "h5pysize": h5.stat().st_size, "h5size": h5.stat().st_size,
                  "pieces": pieces, "ncsum": ncsum}
        if ncsum is not None:
            expect["ncopensize"] = nc.stat().st_size
        del data
        proxy = Proxy(endpoint, args.latency_ms, args.conn_mbps, work)
        measured = measure(args, proxy, work, env, expect)
        meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{os.cpu_count()} cores", "server": what,
                "h5size": expect["h5size"], "h5pysize": expect["h5size"],
                **({"ncopensize": expect["ncopensize"]} if ncsum is not None else {})}
        text = render(args, measured, meta)
        print(text)
        if not args.no_doc:
            doc = DOC.read_text() if DOC.exists() else ""
            if BEGIN in doc and END in doc:
                doc = doc[:doc.index(BEGIN)] + text + doc[doc.index(END) + len(END):]
            else:
                doc = doc + "\n" + text + "\n"
            DOC.write_text(doc)
    finally:
        if proxy is not None:
            proxy.close()
        if server is not None:
            stop_process(server)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
