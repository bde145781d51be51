"""``faultfs stat MNT``: a live mount's counters as a table (or ``--json``); ``--watch``
refreshes it with rates, as ``iostat`` does."""

from __future__ import annotations

import argparse
import json
import sys
import time

from faultfs.core.units import format_size
from faultfs.fuse.mountpoint import read_stats


def register(sub) -> None:
    s = sub.add_parser("stat", help="show a mount's counters")
    s.add_argument("mountpoint")
    s.add_argument("--json", action="store_true", help="print the raw JSON")
    s.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) with rates, until Ctrl-C")
    s.add_argument("--count", type=int, default=0, help="with --watch: stop after N refreshes")
    s.add_argument("--debug", action="store_true")
    s.set_defaults(func=cmd_stat)


RATE_HEADER = (f"{'time':<9} {'served MB/s':>11} {'source MB/s':>11} {'faults/s':>9} "
               f"{'hit %':>6} {'writes/s':>9} {'written MB/s':>12} {'shared hit %':>12}")


def rates(before: dict, after: dict, seconds: float) -> str:
    """One line of rates between two snapshots."""
    a, b = before.get("counters", {}), after.get("counters", {})

    def delta(name: str) -> int:
        return b.get(name, 0) - a.get(name, 0)

    dt = max(seconds, 1e-9)
    reads = delta("reads")
    hits = f"{100 * delta('hits') / reads:.1f}" if reads else "-"
    looked = delta("shared_hits") + delta("shared_misses")
    shared = f"{100 * delta('shared_hits') / looked:.1f}" if looked else "-"
    return (f"{time.strftime('%H:%M:%S'):<9} {delta('bytes_served') / dt / 1e6:>11.1f} "
            f"{delta('source_bytes') / dt / 1e6:>11.1f} {delta('faults') / dt:>9.1f} "
            f"{hits:>6} {delta('writes') / dt:>9.1f} {delta('bytes_written') / dt / 1e6:>12.1f} "
            f"{shared:>12}")


def watch(mountpoint: str, every: float, count: int) -> int:
    tty = sys.stdout.isatty()
    before, then = read_stats(mountpoint), time.monotonic()
    if not tty:
        print(RATE_HEADER, flush=True)
    done = 0
    try:
        while not count or done < count:
            time.sleep(max(0.1, every))
            snap, now = read_stats(mountpoint), time.monotonic()
            line = rates(before, snap, now - then)
            if tty:  # redraw: the table, then the rates of the last interval
                print("\x1b[H\x1b[2J" + render_stats(snap) + "\n\n" + RATE_HEADER + "\n" + line,
                      flush=True)
            else:
                print(line, flush=True)
            before, then = snap, now
            done += 1
    except KeyboardInterrupt:
        pass
    return 0


def cmd_stat(args: argparse.Namespace) -> int:
    if args.watch is not None:
        return watch(args.mountpoint, args.watch, args.count)
    snap = read_stats(args.mountpoint)
    if args.json:
        print(json.dumps(snap, indent=1, sort_keys=True))
        return 0
    print(render_stats(snap))
    return 0


def _daemon_lines(daemon: dict | None) -> list[str]:
    """When the daemon started, and whether a holder keeps the mount across its crashes."""
    if not daemon:
        return []
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(daemon.get("started") or 0))
    if not daemon.get("holder"):
        return [f"               started {started}; no holder: a crash of the daemon ends "
                "the mount"]
    mounted = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(daemon.get("mount_started") or 0))
    return [f"               started {started}; mounted {mounted}, taken over "
            f"{daemon.get('takeovers', 0)} time(s)"
            + ("" if daemon.get("resend", True) else
               "; this kernel cannot resend requests: a crash ends the mount")]


def _memory_line(snap: dict) -> str:
    buffers = snap.get("read_buffers", {})
    return (f"memory         blobs held {format_size(snap.get('memory_bytes', 0))}; read buffers "
            f"{buffers.get('mapped', 0)} mapped, {buffers.get('reused', 0)} reuses, "
            f"{buffers.get('lent', 0)} in use, {format_size(buffers.get('free_bytes', 0))} free")


def _shared_lines(snap: dict, c: dict) -> list[str]:
    shared = snap.get("shared") or {}
    if not shared:
        return []
    state = "up" if shared.get("up", True) else "DOWN (reading from the sources)"
    if shared.get("sealed"):
        state += ", sealed: only objects sealed with the cluster key are used"
    return [
        "",
        f"shared store   {shared.get('url')}  ({state}, {shared.get('publishes_pending', 0)} "
        f"publishes pending)",
        f"{'shared hits':<22}{c.get('shared_hits', 0):>12}    {'shared misses':<22}{c.get('shared_misses', 0):>12}",
        f"{'publishes':<22}{c.get('shared_publishes', 0):>12}    {'publish failures':<22}{c.get('shared_publish_failures', 0):>12}",
        f"{'bytes from shared':<22}{format_size(c.get('shared_bytes_in', 0)):>12}    {'bytes to shared':<22}{format_size(c.get('shared_bytes_out', 0)):>12}",
        f"{'shared errors':<22}{c.get('shared_errors', 0):>12}    {'damaged objects':<22}{c.get('shared_damaged', 0):>12}",
        f"{'published by others':<22}{c.get('shared_publish_skipped', 0):>12}    {'publishes dropped':<22}{c.get('shared_publish_dropped', 0):>12}",
        f"claims         {shared.get('claims', 'off')}  (fetch once per cluster)",
        f"{'claims won':<22}{c.get('claims_won', 0):>12}    {'takeovers':<22}{c.get('claim_takeovers', 0):>12}",
        f"{'waits on other nodes':<22}{c.get('claim_waits', 0):>12}    {'wait time':<22}{c.get('claim_wait_ms', 0) / 1000:>11.1f}s",
        f"{'waits given up':<22}{c.get('claim_waits_given_up', 0):>12}    {'claim errors':<22}{c.get('claim_errors', 0):>12}",
        f"{'bytes from source':<22}{format_size(c.get('source_bytes', 0)):>12}    {'claims released':<22}{c.get('claims_released', 0):>12}",
        f"{'misses by index':<22}{c.get('shared_index_misses', 0):>12}",
    ]


def render_stats(snap: dict) -> str:
    """The counters of ``faultfs stat`` as a readable table."""
    c = snap.get("counters", {})
    w = snap.get("writes", {})
    lat = snap.get("fault_latency", {})
    lines = [
        f"store          {snap.get('store')}  (free {format_size(snap.get('store_free_bytes', 0))}, "
        f"reserve {format_size(snap.get('reserve_bytes', 0))}"
        + (f", cap {format_size(snap['cache_size'])}" if snap.get("cache_size") else "")
        + ("" if snap.get("store_enabled", True) else ", storing OFF (read-through)") + ")"
        + (f"\n  DEGRADED: the store cannot be written ({snap['store_degraded']}): serving what is "
           "staged, reading the rest through" if snap.get("store_degraded") else ""),
        f"daemon         pid {snap.get('pid')}, up {snap.get('uptime_s', 0):.0f} s, "
        f"{snap.get('io_threads')} I/O threads",
        *_daemon_lines(snap.get("daemon")),
        _memory_line(snap),
        "",
        f"{'reads':<22}{c.get('reads', 0):>12}    {'bytes served':<22}{format_size(c.get('bytes_served', 0)):>12}",
        f"{'hits':<22}{c.get('hits', 0):>12}    {'faults':<22}{c.get('faults', 0):>12}",
        f"{'source reads':<22}{c.get('source_reads', 0):>12}    {'bytes from source':<22}{format_size(c.get('source_bytes', 0)):>12}",
        f"{'stored':<22}{c.get('stored', 0):>12}    {'bytes stored':<22}{format_size(c.get('stored_bytes', 0)):>12}",
        f"{'skipped (reserve)':<22}{c.get('skipped_reserve', 0):>12}    {'skipped (no-store)':<22}{c.get('skipped_no_store', 0):>12}",
        f"{'skipped (cache cap)':<22}{c.get('skipped_cache_cap', 0):>12}    {'evicted':<22}{c.get('evicted', 0):>12}",
        f"{'store failures':<22}{c.get('store_failures', 0):>12}    {'read-through (backoff)':<22}{c.get('readthrough_backoff', 0):>12}",
        f"{'fault errors':<22}{c.get('fault_errors', 0):>12}    {'single-flight joins':<22}{c.get('single_flight_joins', 0):>12}",
        f"{'page reads':<22}{c.get('page_reads', 0):>12}    {'page slices':<22}{c.get('page_slices', 0):>12}",
        f"{'zero-filled bytes':<22}{c.get('zero_filled_bytes', 0):>12}    {'stale blobs dropped':<22}{c.get('stale_blobs_dropped', 0):>12}",
        f"{'memory hits':<22}{c.get('memory_hits', 0):>12}    {'read ahead (store)':<22}{c.get('store_readahead', 0):>12}",
        f"{'store reads (ring)':<22}{c.get('ring_reads', 0):>12}    {'corrupt blobs dropped':<22}{c.get('corrupt_blobs_dropped', 0):>12}",
        f"{'reads from a head':<22}{c.get('head_reads', 0):>12}    {'prefetched blobs':<22}{c.get('prefetches', 0):>12}",
        f"{'HDF5 index nodes':<22}{c.get('hdf5_index_nodes', 0):>12}    {'HDF5 lookahead blobs':<22}{c.get('hdf5_lookaheads', 0):>12}",
        f"{'HDF5 leaves ahead':<22}{c.get('hdf5_leaves_ahead', 0):>12}    {'HDF5 listing blobs':<22}{c.get('hdf5_listing_blobs', 0):>12}",
        f"{'HDF5 member blobs':<22}{c.get('hdf5_links_ahead', 0):>12}    {'HDF5 files':<22}{c.get('hdf5_files', 0):>12}",
        f"{'writes':<22}{c.get('writes', 0):>12}    {'bytes written':<22}{format_size(c.get('bytes_written', 0)):>12}",
        f"{'fsyncs':<22}{c.get('fsyncs', 0):>12}    {'folds':<22}{c.get('folds', 0):>12}",
        f"{'checkpoints':<22}{c.get('checkpoints', 0):>12}    {'bytes spilled':<22}{format_size(c.get('spilled_bytes', 0)):>12}",
        f"{'fsyncs joined':<22}{c.get('fsyncs_joined', 0):>12}    {'spills':<22}{c.get('spills', 0):>12}",
        f"{'writes held':<22}{format_size(w.get('held_bytes', 0)):>12}    {'journal':<22}{format_size(w.get('journal_bytes', 0)):>12}",
        f"{'base faults failed':<22}{c.get('base_fault_errors', 0):>12}    {'dirty blobs kept':<22}{c.get('dirty_kept', 0):>12}",
        f"{'other names dropped':<22}{c.get('coherence_drops', 0):>12}    {'drops cut short':<22}{c.get('coherence_held_pages', 0) + c.get('coherence_waits_cut', 0):>12}",
        f"{'requests taken queued':<22}{c.get('fuse_fast_waits', 0):>12}    {'request waits':<22}{c.get('fuse_waits', 0):>12}",
        f"{'fast reads (C)':<22}{c.get('fast_reads', 0):>12}    {'reads passed on':<22}{c.get('fast_passed', 0):>12}",
        f"fault latency  p50 {lat.get('p50_ms', 0)} ms, p90 {lat.get('p90_ms', 0)} ms, "
        f"p99 {lat.get('p99_ms', 0)} ms, max {lat.get('max_ms', 0)} ms",
        *_shared_lines(snap, c),
        "",
        f"{'tag':<20} {'blobs':>9} {'staged':>9} {'dirty':>7} {'chunk':>10} {'size':>11}  source",
    ]
    for name, t in sorted(snap.get("tags", {}).items()):
        lines.append(f"{name:<20} {t['blobs']:>9} {t['staged_blobs']:>9} "
                     f"{t.get('dirty_blobs', 0):>7} {format_size(t['chunk_size']):>10} "
                     f"{format_size(t.get('view_size', t['size'])):>11}  {t['source']}")
        if t.get("dirty_blobs") or t.get("user_blobs"):
            lines.append(f"  written: {t['dirty_blobs']} dirty blobs "
                         f"({format_size(t['dirty_bytes'])}), {t.get('user_blobs', 0)} user blobs")
        if t.get("damaged_blobs"):
            lines.append(f"  damaged (EIO until `faultfs reset`): {', '.join(t['damaged_blobs'])}")
        if t.get("stale_dropped_at_mount") or t.get("source_changed_at_mount"):
            lines.append(f"  source changed since the last mount: {t.get('stale_dropped_at_mount', 0)} "
                         "stale blobs dropped, re-faulting from the new version")
        if t.get("source_changed_under_mount"):
            lines.append(f"  source changed under the mount ({t['source_changed_under_mount']}): "
                         "unstaged blobs fail (EIO) until a remount")
        if t.get("source_error"):
            lines.append(f"  source unavailable: {t['source_error']}")
    return "\n".join(lines)
