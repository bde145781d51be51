"""bench_shared: the shared tier (--shared-store) against reading the source, through a latency proxy.

Run through ``scripts/bench_shared`` (which makes the machine ready first: Debian packages and the
project's venv; s3rver from npm, as ``scripts/bench_s3``). One run, against one S3 endpoint on
127.0.0.1 (s3rver by default, see --server) holding a --size-mb object of random bytes (default
1 GiB), every faultfs daemon reaching it through two ``faultfs.testing.proxy.LatencyProxy``
instances (this kernel has no netem): one in front of the source bucket, one in front of the
shared-store bucket, each adding --latency-ms before every response's first byte and capping each
connection's responses at --conn-mbps (defaults 20 ms and 100 MB/s, as scripts/bench_s3).
The proxies run in a child process, so the readers here do not share a GIL with them.

1. Node B, cold (empty local store, fresh mount, page cache dropped), each --reps times (medians):
   a sequential read of the whole-object view (1 MiB reads: MiB/s) and --random-reads 4 KiB
   ``pread``s at random offsets, each in a different chunk (IOPS; with each --random-threads
   count of reader threads, a fresh mount each), for
   (a) tier:   ``faultfs mount MNT --store EMPTY --shared-store s3://shared/tier`` after node A
       mounted the source with the same --shared-store, read it whole and published every blob;
   (b) source: ``faultfs mount s3://src/key MNT --store EMPTY`` (no shared store).
2. --nodes daemons (separate stores and mountpoints), each ``faultfs mount s3://src/key MNT``
   (with ``--shared-store s3://shared/<fresh prefix>`` or without), each reading the whole view:
   all at once, and one after another (the next starting once the previous one's publishes are
   done); the source bytes summed over the nodes' ``.faultfs/stats`` counters (and as the source
   proxy saw them), the shared-tier counters, and the wall time.

Bytes are verified once per configuration: the sha256 of a node's view after its read against the
object's, and every random read against the generated file. Every mount, daemon, proxy, server
and temporary directory is removed at exit, also on Ctrl-C or SIGTERM. 3. Nodes started together (``scripts/bench_cluster.py``): 2, 4 and 8 nodes reading at once with
   claims and without (--no-shared-claims), sequentially and with 8 random readers, against a
   lone node; and a kill -9 of one of 4 nodes mid-read. --quick: a 32 MiB object, 2 and 4 nodes,
   one rep, part 3 alone (claims need an endpoint with conditional puts: --server moto).

The results replace the
part of docs/benchmarks-shared.md after its results marker (--no-doc to skip).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import (
    BenchError,
    Cleanups,
    aws_env,
    cpu_seconds,
    drop_caches,
    ensure_bucket,
    exit_on_signals,
    is_mounted,
    methods_line,
    s3_client,
    sha256_of,
    start_s3_server,
    stop_process,
    timed_read,
    unmount_and_reap,
)
from benchlib import log as _log

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks-shared.md"
MARKER = "<!-- results: everything below is rewritten by scripts/bench_shared -->"
SRC_BUCKET, SHARED_BUCKET = "faultfs-src", "faultfs-shared"
KEY, TAG = "run42/field.bin", "field"
MiB = 1 << 20
BLOCK = 4096
MOUNT_TIMEOUT_S = 120
UMOUNT_TIMEOUT_S = 180  # an unmount waits for the publishes under way
SETTLE_TIMEOUT_S = 600
CLEAN = Cleanups("bench_shared")


def log(msg: str) -> None:
    _log(msg, "bench_shared")


# --- the two proxies, in a child process ---


def _summary(proxy, with_log: bool) -> dict:
    s = proxy.stats(log=with_log)
    out = {k: s[k] for k in ("requests", "response_bytes", "request_bytes", "peak_in_flight",
                             "avg_in_flight", "connections_total", "upstream_errors")}
    if with_log:
        from faultfs.testing.proxy import LOG_LENGTH

        methods: dict[str, list] = {}
        for rec in s["log"]:  # a listing is "LIST"; a 404 is told apart (a miss)
            kind = "LIST" if "list-type=" in rec["path"] else rec["method"] or "?"
            kind += " 404" if rec["status"] == 404 else ""
            m = methods.setdefault(kind, [0, 0, []])
            m[0] += 1
            m[1] += rec["response_bytes"]
            if rec["end"] is not None:
                m[2].append(rec["end"] - rec["start"])
        out["methods"] = {k: [n, b, statistics.median(d) if d else 0.0]
                          for k, (n, b, d) in methods.items()}
        out["log_complete"] = s["requests"] <= LOG_LENGTH
        out["log"] = [{k: rec[k] for k in ("method", "path", "status", "start", "end")}
                      for rec in s["log"]]  # --keep-logs writes it (on the read's clock)
    return out


def _proxy_host(conn, upstreams: dict[str, int], settings: dict) -> None:
    """The child: one LatencyProxy per path ("source", "shared"), each in front of its S3
    server's port (``upstreams``), answering commands."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent ends us (Ctrl-C reaches both)
    from faultfs.testing.proxy import LatencyProxy

    proxies = {}
    try:
        for name, (delay_ms, conn_mbps, total_mbps) in settings.items():
            proxies[name] = LatencyProxy("127.0.0.1", upstreams[name], delay_ms=delay_ms,
                                         conn_mbps=conn_mbps, total_mbps=total_mbps,
                                         max_connections=4096).start()
        conn.send({name: p.url for name, p in proxies.items()})
        while True:
            try:
                cmd, arg = conn.recv()
            except EOFError:
                return
            if cmd == "reset":
                for p in proxies.values():
                    p.reset_stats()
                conn.send(None)
            elif cmd == "stats":
                conn.send({name: _summary(p, arg) for name, p in proxies.items()})
            else:
                conn.send(None)
                return
    finally:
        for p in proxies.values():
            p.close()


class Proxies:
    def __init__(self, upstreams: dict[str, int], settings: dict) -> None:
        ctx = mp.get_context("fork")  # before any thread of ours is started
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proxy_host, args=(child, upstreams, settings),
                                daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(30):
            self.close()
            raise BenchError("the latency proxies did not start")
        self.urls: dict[str, str] = self.conn.recv()

    def _ask(self, cmd: str, arg=None):
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def reset(self) -> None:
        self._ask("reset")

    def stats(self, with_log: bool = True) -> dict:
        return self._ask("stats", with_log)

    def close(self) -> None:
        with contextlib.suppress(OSError, EOFError, BrokenPipeError):
            self._ask("close")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)


# --- faultfs nodes ---


LIVE: set[Node] = set()
KEEP_LOGS: Path | None = None  # --keep-logs: where each node's daemon log is copied at unmount
KEEP_LOGS_RUN: dict[str, int] = {}


def unmount_all() -> None:
    for node in list(LIVE):
        node.umount()


class Node:
    """One faultfs daemon with its own store and mountpoint."""

    def __init__(self, work: Path, name: str, env: dict, tree: Path = ROOT) -> None:
        self.work = work
        self.name = name
        self.tree = tree  # the faultfs source tree the daemon runs (another: an A/B run)
        self.env = env if tree == ROOT else {**env, "PYTHONPATH": str(tree)}
        self.store = work / f"store-{name}"
        self.mnt = work / f"mnt-{name}"
        self.pid: int | None = None
        self.dev: int | None = None
        self.last: dict = {}
        self.mounting: subprocess.Popen | None = None

    @property
    def view(self) -> Path:
        return self.mnt / TAG / Path(KEY).name

    def mount(self, args: list[str]) -> Node:
        """A fresh mount over an empty store. The `faultfs mount` command runs in a session of
        its own, so a Ctrl-C does not kill it half way (``umount`` waits for it instead)."""
        shutil.rmtree(self.store, ignore_errors=True)
        self.mnt.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "faultfs.cli", "mount", *args, str(self.mnt),
               "--store", str(self.store)]
        LIVE.add(self)
        self.mounting = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, cwd=self.tree,
                                         start_new_session=True)
        try:
            _, err = self.mounting.communicate(timeout=MOUNT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BenchError(f"node {self.name}: faultfs mount did not return in "
                             f"{MOUNT_TIMEOUT_S} s") from None
        if self.mounting.returncode != 0:
            raise BenchError(f"node {self.name}: faultfs mount failed: {err.strip()}")
        self.mounting = None
        self.dev = os.stat(self.mnt).st_dev
        self.pid = int(self.stats()["pid"])
        if not self.view.exists():
            raise BenchError(f"node {self.name} does not show {self.view}")
        return self

    def stats(self) -> dict:
        with open(self.mnt / ".faultfs" / "stats", "rb") as f:
            return json.loads(f.read())

    def counters(self) -> dict:
        return self.stats()["counters"]

    def wait_published(self, timeout: float = SETTLE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while self.stats()["shared"].get("publishes_pending"):
            if time.monotonic() > deadline:
                raise BenchError(f"node {self.name}: publishes still pending after {timeout} s")
            time.sleep(0.02)

    def umount(self) -> None:
        """Unmount (the daemon drains its publishes first), reap the daemon, drop the store."""
        if self.mounting is not None:  # interrupted while mounting: let the mount finish
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.mounting.wait(MOUNT_TIMEOUT_S)
            if self.mounting.poll() is None:
                self.mounting.kill()
                self.mounting.wait()
            self.mounting = None
        if is_mounted(self.mnt):
            with contextlib.suppress(OSError, ValueError, KeyError):
                self.last = self.stats()
                self.pid = self.pid or int(self.last["pid"])
                self.dev = self.dev or os.stat(self.mnt).st_dev
        if KEEP_LOGS is not None:  # the daemon's log, before its store goes
            runs = KEEP_LOGS_RUN.get(self.name, 0) + 1
            KEEP_LOGS_RUN[self.name] = runs
            with contextlib.suppress(OSError):
                shutil.copy(self.store / "log" / "faultfs.log",
                            KEEP_LOGS / f"{self.name}-{runs:03d}.log")
        unmount_and_reap(self.mnt, self.dev, self.pid,
                         [sys.executable, "-m", "faultfs.cli", "umount", str(self.mnt)],
                         timeout=UMOUNT_TIMEOUT_S)
        self.pid = None
        if not is_mounted(self.mnt):
            shutil.rmtree(self.store, ignore_errors=True)
        LIVE.discard(self)


# --- reading ---


def random_offsets(size: int, chunk: int, count: int, seed: int) -> list[int]:
    """``count`` 4 KiB-aligned offsets, each in a different chunk (every read is a cold fault)."""
    rng = random.Random(seed)
    chunks = rng.sample(range(size // chunk), min(count, size // chunk))
    return [c * chunk + rng.randrange(chunk // BLOCK) * BLOCK for c in chunks]


def random_reads(path: Path, offsets: list[int], threads: int) -> tuple[float, list[float],
                                                                       dict[int, bytes]]:
    """Wall seconds, per-read seconds and the bytes read, ``threads`` readers (one fd each)."""
    shares = [offsets[i::threads] for i in range(threads)]
    latencies: list[float] = []
    got: dict[int, bytes] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    start = threading.Barrier(threads + 1)

    def reader(share: list[int]) -> None:
        mine, data = [], {}
        fd = None
        try:
            fd = os.open(path, os.O_RDONLY)
            start.wait()
            for off in share:
                t = time.perf_counter()
                data[off] = os.pread(fd, BLOCK, off)
                mine.append(time.perf_counter() - t)
        except BaseException as exc:
            errors.append(exc)
            start.abort()  # a reader that cannot start must not leave the others waiting
        finally:
            if fd is not None:
                os.close(fd)
        with lock:
            latencies.extend(mine)
            got.update(data)

    workers = [threading.Thread(target=reader, args=(s,), daemon=True) for s in shares]
    for w in workers:
        w.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start.wait()
    t0 = time.perf_counter()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    if errors:
        raise BenchError(f"a random reader of {path} failed: {errors[0]}")
    return wall, latencies, got


def check_random(got: dict[int, bytes], original: Path) -> None:
    with open(original, "rb") as f:
        for off, data in got.items():
            if data != os.pread(f.fileno(), BLOCK, off):
                raise BenchError(f"random read at {off} differs from the object")


def check_view(node: Node, digest: str) -> None:
    if sha256_of(node.view) != digest:
        raise BenchError(f"node {node.name} served bytes that differ from the object")


def stage_and_publish(node: Node, size: int, chunk_blobs: int) -> float:
    """Read the view whole, holding back while the node's publish queue is over half its
    budget (so nothing is dropped), then wait for every publish; seconds."""
    started = time.perf_counter()
    buf = bytearray(MiB)
    fd = os.open(node.view, os.O_RDONLY)
    try:
        total = 0
        while n := os.readv(fd, [buf]):
            total += n
            if total % (32 * MiB) == 0:
                while node.stats()["shared"].get("publish_bytes_waiting", 0) > 128 * MiB:
                    time.sleep(0.02)
    finally:
        os.close(fd)
    if total != size:
        raise BenchError(f"node {node.name} read {total} of {size} bytes")
    node.wait_published()
    c = node.counters()
    if c.get("shared_publish_dropped") or c.get("shared_publishes", 0) < chunk_blobs:
        raise BenchError(f"node {node.name} published {c.get('shared_publishes')} of "
                         f"{chunk_blobs} blobs (dropped {c.get('shared_publish_dropped')})")
    return time.perf_counter() - started


class CpuMeter:
    """CPU seconds of the daemon(s) under test, the proxies' process and the S3 server."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}

    def start(self, daemons: list[int]) -> None:
        self.daemons = daemons
        self.before = self._now()

    def _now(self) -> dict[str, float]:
        out = {name: sum(cpu_seconds(pid) or 0.0 for pid in pids)
               for name, pids in self.pids.items()}
        out["faultfs"] = sum(cpu_seconds(pid) or 0.0 for pid in self.daemons)
        return out

    def stop(self) -> dict[str, float]:
        now = self._now()
        return {k: now[k] - self.before.get(k, 0.0) for k in now}


COUNTERS = ("shared_hits", "shared_misses", "shared_bytes_in", "shared_publishes",
            "shared_publish_skipped", "shared_publish_dropped", "shared_bytes_out",
            "shared_errors", "shared_damaged", "source_reads", "source_bytes")


def pick(counters: dict) -> dict:
    return {k: int(counters.get(k, 0)) for k in COUNTERS}


# --- part 1: one node, tier against source ---


def part1(args, work: Path, env: dict, endpoint: str, proxies: Proxies, cpu: CpuMeter,
          size: int, digest: str, original: Path) -> dict:
    src_args = [f"s3://{SRC_BUCKET}/{KEY}", "--s3-endpoint-url", proxies.urls["source"],
                *args.faultfs_args.split()]
    tier_url = f"s3://{SHARED_BUCKET}/tier"
    shared_args = ["--shared-store", tier_url, "--shared-store-endpoint-url",
                   proxies.urls["shared"], *args.faultfs_args.split()]
    configs = {"tier": shared_args, "source": src_args}

    a = Node(work, "a", env).mount([*src_args, *shared_args[:4]])
    chunk = int(a.stats()["tags"][TAG]["chunk_size"])
    blobs = int(a.stats()["tags"][TAG]["blobs"])
    staged = stage_and_publish(a, size, blobs)
    published = len(list_keys(endpoint, "tier/blobs/"))
    a.umount()
    log(f"node A staged and published {blobs} blobs of {chunk // 1024} KiB in {staged:.1f} s "
        f"({published} blob objects in the shared store)")
    if published < blobs:
        raise BenchError(f"the shared store holds {published} of {blobs} blob objects")

    res: dict = {"chunk": chunk, "blobs": blobs, "stage_s": staged, "seq": {}, "rand": {},
                 "counters": {}, "proxy": {}, "lat": {}, "cpu": {}}
    for cfg in configs:
        res["seq"][cfg] = []
        res["counters"][cfg] = {}
        res["proxy"][cfg] = {}
        res["cpu"][cfg] = {}
        for t in args.threads:
            res["rand"][(cfg, t)] = []
            res["lat"][(cfg, t)] = []
    verified: set = set()
    for rep in range(args.reps):
        order = list(configs) if rep % 2 == 0 else list(configs)[::-1]
        for cfg in order:
            node = Node(work, f"b-{cfg}", env).mount(configs[cfg])
            drop_caches()
            proxies.reset()
            cpu.start([node.pid])
            seconds = timed_read(node.view, size)
            res["cpu"][cfg]["seq"] = cpu.stop()
            res["seq"][cfg].append(seconds)
            res["counters"][cfg]["seq"] = pick(node.counters())
            res["proxy"][cfg]["seq"] = proxies.stats()
            if cfg not in verified:
                check_view(node, digest)
                verified.add(cfg)
            node.umount()
            line = [f"seq {size / MiB / seconds:.0f} MiB/s"]
            for t in args.threads:
                offsets = random_offsets(size, chunk, args.random_reads, 1000 * rep + t)
                node = Node(work, f"b-{cfg}", env).mount(configs[cfg])
                drop_caches()
                proxies.reset()
                cpu.start([node.pid])
                wall, lat, got = random_reads(node.view, offsets, t)
                res["cpu"][cfg][f"rand{t}"] = cpu.stop()
                res["rand"][(cfg, t)].append(len(offsets) / wall)
                res["lat"][(cfg, t)].extend(lat)
                res["counters"][cfg][f"rand{t}"] = pick(node.counters())
                res["proxy"][cfg][f"rand{t}"] = proxies.stats()
                node.umount()
                check_random(got, original)
                line.append(f"rand x{t} {len(offsets) / wall:.0f} IOPS")
            log(f"rep {rep + 1}/{args.reps} {cfg}: " + ", ".join(line))
    return res


def list_keys(endpoint: str, prefix: str) -> list[str]:
    """Keys of the shared bucket under ``prefix`` (straight to the endpoint, not the proxy)."""
    client = s3_client(endpoint)
    keys, token = [], None
    while True:
        kw = {"ContinuationToken": token} if token else {}
        page = client.list_objects_v2(Bucket=SHARED_BUCKET, Prefix=prefix, **kw)
        keys += [o["Key"] for o in page.get("Contents", [])]
        token = page.get("NextContinuationToken")
        if not token:
            return keys


# --- part 2: N nodes ---


def read_at_once(nodes: list[Node], size: int) -> dict[str, float]:
    """Each node's view read whole, all at the same time (a thread each); seconds by node."""
    seconds: dict[str, float] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(nodes))

    def read(n: Node) -> None:
        try:
            start.wait()
            seconds[n.name] = timed_read(n.view, size)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=read, args=(n,), daemon=True) for n in nodes]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise BenchError(f"a node's read failed: {errors[0]}")
    return seconds


def part2(args, work: Path, env: dict, proxies: Proxies, cpu: CpuMeter, size: int,
          digest: str) -> list[dict]:
    rows = []
    cases = [(tier, how) for how in ("at once", "one after another") for tier in (False, True)]
    for rep in range(args.node_reps):
        for tier, how in cases:
            prefix = f"nodes-{rep}-{'tier' if tier else 'none'}-{how.replace(' ', '-')}"
            extra = (["--shared-store", f"s3://{SHARED_BUCKET}/{prefix}",
                      "--shared-store-endpoint-url", proxies.urls["shared"]] if tier else [])
            node_args = [f"s3://{SRC_BUCKET}/{KEY}", "--s3-endpoint-url",
                         proxies.urls["source"], *extra, *args.faultfs_args.split()]
            nodes = [Node(work, f"n{i}", env) for i in range(args.nodes)]
            for n in nodes:
                n.mount(node_args)
            drop_caches()
            proxies.reset()
            cpu.start([n.pid for n in nodes])
            seconds: dict[str, float] = {}
            started = time.perf_counter()
            if how == "at once":
                seconds = read_at_once(nodes, size)
                wall = time.perf_counter() - started
                for n in nodes:
                    if tier:
                        n.wait_published()
                settled = time.perf_counter() - started
            else:
                for n in nodes:
                    seconds[n.name] = timed_read(n.view, size)
                    if tier:
                        n.wait_published()  # the next node starts once these are out
                wall = settled = time.perf_counter() - started
            used = cpu.stop()
            sums = {k: 0 for k in COUNTERS}
            for n in nodes:
                for k, v in pick(n.counters()).items():
                    sums[k] += v
            per_node = [pick(n.counters())["source_bytes"] for n in nodes]
            seen = proxies.stats()
            if rep == 0:
                for n in nodes:
                    check_view(n, digest)
            for n in nodes:
                n.umount()
            rows.append({"tier": tier, "how": how, "rep": rep, "wall": wall,
                         "settled": settled, "seconds": [seconds[n.name] for n in nodes],
                         "sums": sums, "per_node_source": per_node, "proxy": seen,
                         "cpu": used})
            log(f"{args.nodes} nodes {how}, {'shared tier' if tier else 'no shared tier'}: "
                f"wall {wall:.1f} s, source {sums['source_bytes'] / size:.2f}× the object "
                f"(per node {[round(b / size, 2) for b in per_node]}), shared hits "
                f"{sums['shared_hits']}, publishes {sums['shared_publishes']}, dropped "
                f"{sums['shared_publish_dropped']}")
    return rows


# --- the report ---


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def flight(stats: dict) -> str:
    if not stats.get("requests"):
        return ""
    return f"[{stats['avg_in_flight']:.1f}, {stats['peak_in_flight']}]"


def render(args, res1: dict | None, rows2: list[dict], size: int, meta: dict,
           res3: dict | None = None) -> str:
    mib = size // MiB
    out = [f"Object: {mib} MiB of random bytes in S3 ({meta['server']} on 127.0.0.1); every "
           f"daemon reaches the source bucket and the shared-store bucket through its own "
           f"LatencyProxy: {meta['proxy']}. faultfs defaults (1 MiB chunks) "
           f"{args.faultfs_args or ''}".rstrip() + ".", ""]
    if res1 is not None:
        n = len(random_offsets(size, res1["chunk"], args.random_reads, 0))
        out += [f"### 1. Node B cold: from the shared tier or from the source (median of "
                f"{args.reps})", "",
                f"Node A mounted the source with `--shared-store`, read it whole and published "
                f"its {res1['blobs']} blobs in {res1['stage_s']:.1f} s (not timed below). "
                f"B: empty store, fresh mount, page cache dropped; sequential = one pass of "
                f"1 MiB reads over the view; random = {n} `pread`s of 4 KiB, each in a "
                f"different chunk, split over the reader threads.", "",
                "| cold read on node B | (a) shared tier | (b) source | tier / source |",
                "| --- | ---: | ---: | ---: |"]
        a, b = med(res1["seq"]["tier"]), med(res1["seq"]["source"])
        out.append(f"| sequential, MiB/s | {mib / a:.0f} | {mib / b:.0f} | {b / a:.2f}× |")
        for t in args.threads:
            ia, ib = med(res1["rand"][("tier", t)]), med(res1["rand"][("source", t)])
            out.append(f"| random 4 KiB, {t} reader{'s' if t > 1 else ''}, IOPS | {ia:.0f} | "
                       f"{ib:.0f} | {ia / ib:.2f}× |")
        for t in args.threads:
            la, lb = med(res1["lat"][("tier", t)]), med(res1["lat"][("source", t)])
            out.append(f"| random 4 KiB, {t} reader{'s' if t > 1 else ''}, median latency ms "
                       f"| {la * 1e3:.1f} | {lb * 1e3:.1f} | {la / lb:.2f}× |")
        out += ["", "Per rep: " + "; ".join(
            f"{cfg} seq " + " ".join(f"{mib / s:.0f}" for s in res1["seq"][cfg]) + " MiB/s, "
            + ", ".join(f"rand x{t} " + " ".join(f"{v:.0f}" for v in res1["rand"][(cfg, t)])
                        + " IOPS" for t in args.threads)
            for cfg in ("tier", "source")) + ".", "",
            "Where B's bytes came from (its counters, last rep) and the requests each proxy "
            "saw (count, median time from request to last response byte; requests in flight "
            "over the read: mean and peak), and the CPU seconds each process used during the "
            "read:", "",
            "| B read | shared hits | shared bytes in | source reads | source bytes | "
            "requests to the shared store [in flight: mean, peak] | requests to the source | "
            "CPU s: daemon / proxies / S3 server |",
            "| --- | ---: | ---: | ---: | ---: | --- | --- | --- |"]
        for cfg in ("tier", "source"):
            for what in ["seq", *[f"rand{t}" for t in args.threads]]:
                c, p = res1["counters"][cfg][what], res1["proxy"][cfg][what]
                label = "sequential" if what == "seq" else f"random x{what[4:]}"
                u = res1["cpu"][cfg][what]
                out.append(f"| ({'a' if cfg == 'tier' else 'b'}) {cfg}, {label} | "
                           f"{c['shared_hits']} | {c['shared_bytes_in'] / MiB:.1f} MiB | "
                           f"{c['source_reads']} | {c['source_bytes'] / MiB:.1f} MiB | "
                           f"{methods_line(p['shared'])} {flight(p['shared'])} | "
                           f"{methods_line(p['source'])} {flight(p['source'])} | "
                           f"{u['faultfs']:.1f} / {u['proxies']:.1f} / {u['s3']:.1f} |")
        out.append("")
    if rows2:
        out += [f"### 2. {args.nodes} nodes each reading the whole object", "",
                f"{args.nodes} daemons, separate stores and mountpoints, each `faultfs mount "
                f"s3://…/{Path(KEY).name} MNT --store OWN` (with `--shared-store` on a fresh "
                "prefix, or without), page cache dropped, then each reads its view whole "
                "(1 MiB reads): all at once (one thread per node), or one after another (with "
                "the tier, the next node starts when the previous one's publishes are done). "
                "Source bytes are summed over the nodes' counters; the source proxy's count "
                "(response bytes, heads included) is beside it. Wall: first read started to "
                "last read done (one after another: including the waits for publishes); "
                "settled: until every publish is done.", "",
                "| nodes read | shared tier | wall s | settled s | source bytes (counters) | "
                "× object | per node | source proxy bytes | shared hits | shared bytes in | "
                "publishes | publishes dropped |",
                "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
        for r in rows2:
            s = r["sums"]
            out.append(
                f"| {r['how']} | {'yes' if r['tier'] else 'no'} | {r['wall']:.1f} | "
                f"{r['settled']:.1f} | {s['source_bytes'] / MiB:.0f} MiB | "
                f"{s['source_bytes'] / size:.2f}× | "
                + " ".join(f"{b / size:.2f}" for b in r["per_node_source"])
                + f" | {r['proxy']['source']['response_bytes'] / MiB:.0f} MiB | "
                f"{s['shared_hits']} | {s['shared_bytes_in'] / MiB:.0f} MiB | "
                f"{s['shared_publishes']} | {s['shared_publish_dropped']} |")
        out += ["", "Seconds of each node's read: " + "; ".join(
            f"{r['how']}, {'tier' if r['tier'] else 'no tier'}: "
            + " ".join(f"{s:.1f}" for s in r["seconds"]) for r in rows2) + ".", "",
            "Requests each proxy saw, and CPU seconds (daemons together / proxies / S3 "
            "server) until settled:", ""]
        for r in rows2:
            u = r["cpu"]
            out.append(f"- {r['how']}, {'tier' if r['tier'] else 'no tier'}: shared store "
                       f"{methods_line(r['proxy']['shared'])}; source "
                       f"{methods_line(r['proxy']['source'])}; CPU {u['faultfs']:.1f} / "
                       f"{u['proxies']:.1f} / {u['s3']:.1f}")
        out.append("")
    if res3:
        from bench_cluster import render3

        out += render3(args, res3, size)
    out += [f"Versions: {meta['server']}; {meta['faultfs']}.",
            f"Machine: {platform.platform()}, {os.cpu_count()} CPUs (shared with other jobs), "
            f"python {platform.python_version()}; total time {meta['elapsed']:.0f} s.", "",
            "Command:", "", "```", meta["command"], "```"]
    return "\n".join(out)


def write_doc(table: str) -> None:
    head = DOC.read_text().split(MARKER)[0] if DOC.exists() else (
        "# Shared-tier benchmark\n\nSee `scripts/bench_shared --help`.\n\n## Results\n\n")
    DOC.write_text(head.rstrip("\n") + "\n\n" + MARKER + "\n\n" + table + "\n")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=1024, help="object size in MiB (1024)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of part 1 (3)")
    p.add_argument("--random-reads", type=int, default=256,
                   help="4 KiB random reads per random case, each in another chunk (256)")
    p.add_argument("--random-threads", default="1,8",
                   help="reader threads of the random cases, comma-separated (1,8)")
    p.add_argument("--nodes", type=int, default=4, help="nodes of part 2 (4)")
    p.add_argument("--node-reps", type=int, default=1, help="repetitions of part 2 (1)")
    p.add_argument("--parts", default="1,2,3", help="which parts to run (1,2,3)")
    p.add_argument("--latency-ms", type=float, default=20.0,
                   help="proxy delay before each response's first byte (20, as bench_s3)")
    p.add_argument("--conn-mbps", type=float, default=100.0,
                   help="proxy cap per connection, MB/s; 0 = none (100, as bench_s3)")
    p.add_argument("--total-mbps", type=float, default=0.0,
                   help="proxy cap of all connections of one path together, MB/s; 0 = none")
    p.add_argument("--shared-latency-ms", type=float,
                   help="for the shared store (default: --latency-ms)")
    p.add_argument("--shared-conn-mbps", type=float,
                   help="for the shared store (default: --conn-mbps)")
    p.add_argument("--server", choices=("s3rver", "moto"), default="s3rver",
                   help="the S3 endpoint (s3rver; moto is slow for ranged reads)")
    p.add_argument("--source-server", choices=("same", "s3rver", "moto"), default="same",
                   help="the source object on an S3 server of its own (same: on --server's). "
                        "moto copies the whole object for each ranged GET (its CPU grows "
                        "with the object); s3rver streams the range, but has no conditional "
                        "puts, which the shared store's claims need")
    p.add_argument("--faultfs-args", default="", help="extra `faultfs mount` arguments")
    p.add_argument("--dir", help="work directory (default: a new one under /tmp, removed)")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "faultfs-bench"),
                   help="where s3rver is installed")
    p.add_argument("--no-doc", action="store_true", help="do not rewrite the doc")
    p.add_argument("--cluster-nodes", default="2,4,8",
                   help="node counts of part 3, comma-separated (2,4,8)")
    p.add_argument("--cluster-reps", type=int, default=3, help="repetitions of part 3 (3)")
    p.add_argument("--keep-logs", metavar="DIR",
                   help="copy each node's daemon log here at unmount (NAME-RUN.log)")
    p.add_argument("--base-tree", metavar="DIR", type=Path,
                   help="part 3's nodes with claims (lone, and each count) also run the "
                        "faultfs of this source tree (its compiled extensions beside it), in "
                        "the same reps: an A/B")
    p.add_argument("--lone-cases", default="none,claims,no-claims",
                   help="part 3's lone-node cases (none,claims,no-claims)")
    p.add_argument("--cluster-cases", default="claims,no-claims",
                   help="part 3's cases of 2 nodes and more (claims always; no-claims); with "
                        "--base-tree, its faultfs's nodes run beside each count too")
    p.add_argument("--quick", action="store_true",
                   help="part 3 alone, 32 MiB, 2 and 4 nodes, one rep, moto, no doc")
    args = p.parse_args()
    if args.quick:
        args.parts, args.size_mb, args.cluster_nodes, args.cluster_reps = "3", 32, "2,4", 1
        args.server, args.no_doc = "moto", True
    args.cluster_counts = [int(n) for n in args.cluster_nodes.split(",") if n.strip()]
    args.src_bucket = SRC_BUCKET
    args.threads = [int(t) for t in args.random_threads.split(",") if t.strip()]
    args.part_set = {int(x) for x in args.parts.split(",") if x.strip()}
    return args


def main() -> int:
    global KEEP_LOGS
    args = parse_args()
    if args.keep_logs:
        KEEP_LOGS = Path(args.keep_logs)
        KEEP_LOGS.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        raise SystemExit("bench_shared: needs root (drop_caches, FUSE mounts)")
    exit_on_signals()
    started = time.monotonic()
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench_shared-"))
    work.mkdir(parents=True, exist_ok=True)

    def remove_work() -> None:
        held = [line.split()[1] for line in open("/proc/self/mounts")
                if line.split()[1].startswith(str(work))]
        if held:
            log(f"not removing {work}: still mounted: {held}")
        elif not args.dir:
            shutil.rmtree(work, ignore_errors=True)

    CLEAN.push("work directory", remove_work)
    size = args.size_mb * MiB
    command = "scripts/bench_shared " + " ".join(sys.argv[1:])
    try:
        conn_mbps = args.conn_mbps or None
        total = args.total_mbps or None
        settings = {"source": (args.latency_ms, conn_mbps, total),
                    "shared": (args.latency_ms if args.shared_latency_ms is None
                               else args.shared_latency_ms,
                               conn_mbps if args.shared_conn_mbps is None
                               else (args.shared_conn_mbps or None), total)}
        endpoint, server, proc = start_s3_server(args.server, work,
                                                 Path(args.cache) / "s3rver", SRC_BUCKET,
                                                 who="bench_shared")
        CLEAN.push("S3 server", lambda: stop_process(proc))
        src_endpoint, servers = endpoint, [proc]
        if args.source_server not in ("same", args.server):  # the source on a server apart
            src_endpoint, src_server, src_proc = start_s3_server(
                args.source_server, work, Path(args.cache) / "s3rver", SRC_BUCKET,
                who="bench_shared")
            CLEAN.push("source S3 server", lambda: stop_process(src_proc))
            servers.append(src_proc)
            server = f"{server} holding the shared store, {src_server} the source"
        # forked before any thread of ours (boto3's, the readers') exists
        proxies = Proxies({"source": int(src_endpoint.rsplit(":", 1)[1]),
                           "shared": int(endpoint.rsplit(":", 1)[1])}, settings)
        CLEAN.push("latency proxies", proxies.close)
        log(f"endpoint {endpoint}, source {src_endpoint} ({server}); proxies {proxies.urls}")

        original = work / "field.bin"
        h = hashlib.sha256()
        with open(original, "wb") as f:  # random bytes: nothing compresses or dedups
            for _ in range(args.size_mb):
                block = os.urandom(MiB)
                h.update(block)
                f.write(block)
        digest = h.hexdigest()
        ensure_bucket(s3_client(endpoint), SHARED_BUCKET)
        client = s3_client(src_endpoint)
        ensure_bucket(client, SRC_BUCKET)
        t = time.monotonic()
        with open(original, "rb") as f:
            client.put_object(Bucket=SRC_BUCKET, Key=KEY, Body=f)
        log(f"uploaded {args.size_mb} MiB in {time.monotonic() - t:.1f} s")

        cpu = CpuMeter({"proxies": [proxies.proc.pid], "s3": [p.pid for p in servers]})
        env = aws_env(work)
        CLEAN.push("mounts", unmount_all)
        res1 = part1(args, work, env, endpoint, proxies, cpu, size, digest, original) \
            if 1 in args.part_set else None
        rows2 = part2(args, work, env, proxies, cpu, size, digest) if 2 in args.part_set else []
        res3 = None
        if 3 in args.part_set:
            from bench_cluster import part3

            res3 = part3(args, work, env, proxies, size, digest, Node=Node,
                         timed_read=timed_read, drop_caches=drop_caches, check_view=check_view,
                         bucket=SHARED_BUCKET, key=KEY, log=log, cpu=cpu)

        rev = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                             text=True, cwd=ROOT).stdout.strip()
        from faultfs import __version__

        def describe(delay, mbps, total_mbps) -> str:
            cap = f"{mbps:.0f} MB/s per connection" if mbps else "no bandwidth cap"
            if total_mbps:
                cap += f", {total_mbps:.0f} MB/s in all"
            return f"{delay:.0f} ms before each response's first byte, {cap}"

        proxy_text = describe(*settings["source"])
        if settings["shared"] != settings["source"]:
            proxy_text = (f"source {proxy_text}; shared store {describe(*settings['shared'])}")
        meta = {"server": server, "proxy": proxy_text,
                "faultfs": f"faultfs {__version__} ({rev or 'no git'})",
                "command": command, "elapsed": time.monotonic() - started}
        table = render(args, res1, rows2, size, meta, res3)
        print(table)
        if not args.no_doc:
            write_doc(table)
            log(f"wrote {DOC.relative_to(ROOT)}")
    except BenchError as exc:
        raise SystemExit(f"bench_shared: {exc}") from None
    finally:
        CLEAN.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
