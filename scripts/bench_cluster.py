"""Part 3 of bench_shared: nodes started together (DESIGN §17, fetch once per cluster).

For each count of nodes in --cluster-nodes (2,4,8), --cluster-reps times: that many daemons
(own stores and mountpoints, the source and the shared store behind the latency proxies of
bench_shared) mounted, page cache dropped, then all read the whole object at the same moment,
sequentially (1 MiB reads) and with 8 random readers each (1 MiB ``pread``s of every chunk in a
shuffled order, split over 8 threads), with claims (the default) and with
``--no-shared-claims`` (every node fetches what it misses: the shared tier before claims). A
lone node reads the same way without a shared store and with one, for the baselines. One more
case kills (-9) one of 4 nodes half a second into a sequential read: the others must finish
with the right bytes, and the source proxy's bytes say how often each blob was served.

Medians over the reps: source bytes / object (summed over the nodes' counters), and the
slowest node's seconds / the lone node's seconds without a shared store (same mode, same run).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import statistics
import threading
import time
from pathlib import Path

from benchlib import methods_line

MiB = 1 << 20
READERS = 8
NODE_COUNTERS = ("shared_hits", "shared_misses", "claims_won", "claim_waits", "claim_wait_ms",
                 "claim_takeovers", "claim_waits_given_up", "claim_errors", "shared_publishes",
                 "shared_publish_skipped", "shared_publishes_held", "shared_index_misses",
                 "claims_grown", "claims_renewed", "claim_path_faults", "claim_path_ms")


def random_read(view: Path, size: int, seed: int) -> float:
    """Every 1 MiB chunk of ``view`` once, shuffled, over ``READERS`` threads: seconds."""
    offsets = list(range(0, size, MiB))
    random.Random(seed).shuffle(offsets)
    errors: list[BaseException] = []
    fd = os.open(view, os.O_RDONLY)

    def reader(share: list[int]) -> None:
        try:
            for off in share:
                if len(os.pread(fd, MiB, off)) != min(MiB, size - off):
                    raise OSError(f"short read at {off}")
        except BaseException as exc:
            errors.append(exc)

    started = time.perf_counter()
    try:
        threads = [threading.Thread(target=reader, args=(offsets[i::READERS],))
                   for i in range(READERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        os.close(fd)
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def at_once(fns: list) -> list[float]:
    """The callables in threads released together; their results (raises the first error)."""
    start = threading.Barrier(len(fns))
    out: list = [None] * len(fns)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            start.wait()
            out[i] = fns[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def part3(args, work: Path, env: dict, proxies, size: int, digest: str, *, Node, timed_read,
          drop_caches, check_view, bucket: str, key: str, log, cpu=None) -> dict:
    """The runs; ``{(case, nodes, mode): [{"source": ratio, "slowest": s, ...}, ...]}``."""
    results: dict = {}

    def run(case: str, count: int, mode: str, rep: int) -> None:
        extra: list[str] = []
        if case != "none":
            extra = ["--shared-store", f"s3://{bucket}/cluster-{case}-{count}-{mode}-{rep}",
                     "--shared-store-endpoint-url", proxies.urls["shared"]]
        if case == "no-claims":
            extra.append("--no-shared-claims")
        node_args = [f"s3://{args.src_bucket}/{key}", "--s3-endpoint-url",
                     proxies.urls["source"], *extra, *args.faultfs_args.split()]
        tree = {"tree": args.base_tree} if case == "claims-base" else {}
        nodes = [Node(work, f"c{i}", env, **tree) for i in range(count)]
        for n in nodes:
            n.mount(node_args)
        try:
            drop_caches()
            proxies.reset()
            if mode == "seq":
                fns = [lambda n=n: timed_read(n.view, size) for n in nodes]
            else:
                fns = [lambda n=n, i=i: random_read(n.view, size, rep * 100 + i)
                       for i, n in enumerate(nodes)]
            if cpu is not None:
                cpu.start([n.pid for n in nodes])
            started = time.monotonic()
            seconds = at_once(fns)
            wall = time.monotonic() - started
            ended = time.strftime("%H:%M:%S") + f".{int(time.time() * 1000) % 1000:03d}"
            used = cpu.stop() if cpu is not None else {}
            for n in nodes:
                if case != "none":
                    n.wait_published()
            full = [n.stats() for n in nodes]
            counters = [f["counters"] for f in full]
            if rep == 0 and case == "claims":
                for n in nodes:
                    check_view(n, digest)
            seen = proxies.stats(bool(args.keep_logs))
            if args.keep_logs:  # every request both proxies saw, on the read's clock
                Path(args.keep_logs, f"requests-{case}-{count}-{mode}-{rep}.json").write_text(
                    json.dumps({"read_started": started, "read_s": seconds, "proxies": seen}))
        finally:
            for n in nodes:
                n.umount()
        source = sum(c["source_bytes"] for c in counters)
        row = {"seconds": seconds, "source": source / size,
               "proxy_source": seen["source"]["response_bytes"] / size,
               "won": sum(c.get("claims_won", 0) for c in counters),
               "waits": sum(c.get("claim_waits", 0) for c in counters),
               "wait_s": sum(c.get("claim_wait_ms", 0) for c in counters) / 1000,
               "takeovers": sum(c.get("claim_takeovers", 0) for c in counters),
               "given_up": sum(c.get("claim_waits_given_up", 0) for c in counters)}
        results.setdefault((case, count, mode), []).append(row)
        for n, secs, c, f in zip(nodes, seconds, counters, full, strict=True):
            log(f"  {n.name} {secs:.2f} s: source {c['source_bytes'] / size:.2f}x in "
                f"{c.get('source_reads', 0)} reads, " + ", ".join(
                    f"{k} {c.get(k, 0)}" for k in NODE_COUNTERS)
                + f", faults p50/p90 {f['fault_latency']['p50_ms']:.0f}/"
                  f"{f['fault_latency']['p90_ms']:.0f} ms")
        if used:  # what the read cost the machine's CPUs (shared with other jobs)
            log(f"  CPU s over the {wall:.1f} s read: daemons {used['faultfs']:.1f}, proxies "
                f"{used['proxies']:.1f}, S3 server {used['s3']:.1f} (= "
                f"{sum(used.values()) / wall:.2f} CPUs); load average "
                f"{open('/proc/loadavg').read().split()[0]}")
        if args.keep_logs:
            log(f"  requests: shared store {methods_line(seen['shared'])}; source "
                f"{methods_line(seen['source'])}")
        log(f"{count} node(s), {case}, {mode}: reads ended {ended}, slowest "
            f"{max(seconds):.2f} s, source "
            f"{row['source']:.2f}x, claims won {row['won']}, waits {row['waits']} "
            f"({row['wait_s']:.1f} s), takeovers {row['takeovers']}")

    for rep in range(args.cluster_reps):
        for mode in ("seq", "rand"):
            lone = args.lone_cases.split(",")
            for case in ("none", "claims", "claims-base", "no-claims"):
                # no-claims: the tier's own cost on a lone node, apart; claims-base: the
                # --base-tree's faultfs (A/B); a case with its rows
                if case in lone or (case == "claims-base" and args.base_tree):
                    run(case, 1, mode, rep)
            for count in args.cluster_counts:
                run("claims", count, mode, rep)
                if args.base_tree:  # the nodes of the --base-tree's faultfs, same rep
                    run("claims-base", count, mode, rep)
                if "no-claims" in args.cluster_cases.split(","):
                    run("no-claims", count, mode, rep)
    if not args.cluster_counts:  # --cluster-nodes '': the lone nodes alone
        return results
    results["kill"] = kill_run(args, work, env, proxies, size, digest, Node=Node,
                               timed_read=timed_read, drop_caches=drop_caches, bucket=bucket,
                               key=key, log=log)
    return results


def kill_run(args, work: Path, env: dict, proxies, size: int, digest: str, *, Node,
             timed_read, drop_caches, bucket: str, key: str, log) -> dict:
    """4 nodes at once, sequential; node 0 killed -9 half a second in."""
    node_args = [f"s3://{args.src_bucket}/{key}", "--s3-endpoint-url", proxies.urls["source"],
                 "--shared-store", f"s3://{bucket}/cluster-kill",
                 "--shared-store-endpoint-url", proxies.urls["shared"],
                 *args.faultfs_args.split()]
    nodes = [Node(work, f"k{i}", env) for i in range(4)]
    for n in nodes:
        n.mount(node_args)
    victim = nodes[0]
    try:
        drop_caches()
        proxies.reset()

        def doomed() -> float:
            try:
                return timed_read(victim.view, size)
            except OSError:
                return float("nan")

        timer = threading.Timer(0.5, lambda: os.kill(victim.pid, signal.SIGKILL))
        timer.start()
        seconds = at_once([doomed, *[lambda n=n: timed_read(n.view, size) for n in nodes[1:]]])
        timer.join()
        for n in nodes[1:]:
            n.wait_published()
        right = all(sha256(n.view) == digest for n in nodes[1:])
        counters = [n.counters() for n in nodes[1:]]
        seen = proxies.stats(False)
    finally:
        for n in nodes:
            try:
                n.umount()
            except Exception as exc:  # the killed node's mount is dead: unmounted anyway
                log(f"unmounting {n.name}: {exc}")
    out = {"right": right, "seconds": seconds[1:],
           "proxy_source": seen["source"]["response_bytes"] / size,
           "survivors_source": sum(c["source_bytes"] for c in counters) / size,
           "takeovers": sum(c.get("claim_takeovers", 0) for c in counters)}
    log(f"kill -9 of 1 of 4 nodes: bytes right {right}, source proxy {out['proxy_source']:.2f}x,"
        f" takeovers {out['takeovers']}")
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(MiB):
            h.update(block)
    return h.hexdigest()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def render3(args, results: dict, size: int) -> list[str]:
    mib = size // MiB
    out = [f"### 3. Nodes started together (fetch once per cluster; median of "
           f"{args.cluster_reps})", "",
           f"Each node reads the whole {mib} MiB object at the same moment as the others: "
           f"sequentially (1 MiB reads) or with {READERS} random readers (every 1 MiB chunk "
           "once, shuffled). Source = bytes read from the source summed over the nodes' "
           "counters, over the object; slowest / lone = the slowest node's seconds over a "
           "lone node's without a shared store, same mode, same run. *claims*: the default; "
           "*no claims*: `--no-shared-claims` (the shared tier as it was before claims).", "",
           "| nodes | read | source × object, claims | no claims | slowest / lone, claims "
           "| no claims | waits on other nodes (s) | takeovers |",
           "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for mode, label in (("seq", "sequential"), ("rand", f"{READERS} random readers")):
        lone = med([max(r["seconds"]) for r in results[("none", 1, mode)]])
        for count in [1, *args.cluster_counts]:
            c = results.get(("claims", count, mode))
            if not c:  # (--lone-cases without claims)
                continue
            n = results.get(("no-claims", count, mode), [])
            out.append(
                f"| {count} | {label} | {med([r['source'] for r in c]):.2f} | "
                + (f"{med([r['source'] for r in n]):.2f}" if n else "-") + " | "
                f"{med([max(r['seconds']) for r in c]) / lone:.2f} | "
                + (f"{med([max(r['seconds']) for r in n]) / lone:.2f}" if n else "-") + " | "
                f"{med([r['waits'] for r in c]):.0f} ({med([r['wait_s'] for r in c]):.1f}) | "
                f"{med([r['takeovers'] for r in c]):.0f} |")
        out.append(f"| 1 | {label}, no shared store (lone) | 1.00 | - | 1.00 ({lone:.2f} s) "
                   "| - | - | - |")
    for mode in ("seq", "rand"):  # --base-tree: an A/B of each node count, rep by rep
        for count in [1, *args.cluster_counts]:
            base = results.get(("claims-base", count, mode))
            if not base:
                continue
            this = results.get(("claims", count, mode))
            if not this:
                continue
            lone_s = [max(r["seconds"]) for r in results[("none", 1, mode)]]
            new_s = [max(r["seconds"]) for r in this]
            old_s = [max(r["seconds"]) for r in base]
            out += ["", f"{count} node(s), {mode}, this tree against --base-tree (claims; "
                    f"slowest node, medians of {len(base)}): lone without a shared store "
                    f"{med(lone_s):.2f} s, this tree {med(new_s):.2f} s "
                    f"({med(new_s) / med(lone_s):.2f}×), base {med(old_s):.2f} s "
                    f"({med(old_s) / med(lone_s):.2f}×); source × object this/base "
                    f"{med([r['source'] for r in this]):.2f}/"
                    f"{med([r['source'] for r in base]):.2f}; per rep lone/this/base: "
                    + ", ".join(f"{a:.2f}/{b:.2f}/{c:.2f}" for a, b, c in zip(
                        lone_s, new_s, old_s, strict=True)) + "."]
    k = results.get("kill")
    out += [] if k is None else ["", f"kill -9 of one of 4 nodes 0.5 s into a sequential read: the other three "
            f"read {'the right bytes' if k['right'] else 'WRONG BYTES'} in "
            + ", ".join(f"{s:.1f}" for s in k["seconds"]) + " s; the source proxy served "
            f"{k['proxy_source']:.2f}× the object (heads included), the survivors' counters "
            f"{k['survivors_source']:.2f}×; takeovers {k['takeovers']}.", ""]
    out += ["Seconds per run (slowest node), claims: " + "; ".join(
        f"{count} {mode} " + " ".join(f"{max(r['seconds']):.1f}"
                                      for r in results[("claims", count, mode)])
        for mode in ("seq", "rand") for count in [1, *args.cluster_counts]
        if ("claims", count, mode) in results) + ".", ""]
    return out
