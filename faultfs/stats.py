"""Counters per stage of the fault path, and fault latency percentiles.

One ``Stats`` object is shared by the tiers and the engine of a mount; it is what
``.faultfs/stats`` and ``faultfs stat`` show under ``counters``. Counter names are fixed
(``COUNTERS``): adding to an unknown one is a bug, not a new counter.
"""

from __future__ import annotations

import bisect
import collections
import time

LATENCY_SAMPLES = 2048  # fault latencies kept for percentiles
# Upper bounds (seconds) of the fault latency histogram (cumulative, since the mount started)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5, 5.0, 10.0)

COUNTERS = (
    "reads", "hits", "faults", "fault_errors", "single_flight_joins", "head_reads", "split_faults",
    "source_reads",
    "source_bytes", "stored", "stored_bytes", "skipped_reserve", "skipped_no_store",
    "skipped_cache_cap", "store_failures", "readthrough_backoff", "evicted", "evicted_bytes",
    "zero_filled_bytes", "bytes_served", "page_reads", "page_slices", "page_errors",
    "stale_blobs_dropped", "corrupt_blobs_dropped", "memory_hits", "prefetches",
    "prefetch_errors", "prefetch_skipped_memory", "hdf5_files", "hdf5_index_nodes",
    "hdf5_leaves_ahead", "hdf5_listing_blobs", "hdf5_links_ahead", "hdf5_lookaheads", "hdf5_errors", "store_readahead", "ring_reads", "dirty_kept", "skipped_dirty", "skipped_degraded",
    "writes", "bytes_written", "fsyncs", "fsyncs_joined", "folds", "checkpoints", "spills", "spilled_bytes",
    "base_fault_errors", "coherence_drops", "coherence_held_pages", "coherence_waits_cut",
    "coherence_claimed_bytes",
    "xattrs_refused", "fuse_fast_waits", "fuse_waits", "fuse_waits_lost",
    "fast_reads", "fast_passed",
    "shared_hits", "shared_misses", "shared_index_misses", "shared_damaged", "shared_errors", "shared_skipped",
    "shared_publishes", "shared_publish_failures", "shared_publish_skipped",
    "shared_publish_dropped", "shared_publishes_held", "shared_bytes_in", "shared_bytes_out",
    "claims_won", "claim_takeovers", "claim_waits", "claim_wait_ms", "claim_waits_given_up",
    "claims_released", "claims_grown", "claims_grow_deferred", "claims_renewed", "claims_ahead",
    "claim_errors",
    "claim_path_faults",
    "claim_path_ms",
)


class Latencies(collections.deque[float]):
    """The most recent fault latencies (for percentiles), and a histogram of all of them
    since the mount (for monitoring: Prometheus wants cumulative buckets)."""

    def __init__(self) -> None:
        super().__init__(maxlen=LATENCY_SAMPLES)
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last is +Inf
        self.total = 0
        self.sum = 0.0

    def append(self, seconds: float) -> None:
        super().append(seconds)
        self.total += 1
        self.sum += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def histogram(self) -> dict:
        """``{"le": [bounds], "counts": [cumulative], "count": n, "sum": s}``."""
        counts, running = [], 0
        for n in self.buckets:
            running += n
            counts.append(running)
        return {"le": [*LATENCY_BUCKETS, "+Inf"], "counts": counts, "count": self.total,
                "sum": round(self.sum, 6)}


class Stats:
    """The counters and the fault latencies."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latencies = Latencies()
        self.started = time.time()

    def add(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def percentiles(self) -> dict[str, float]:
        if not self.latencies:
            return {"p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        data = sorted(self.latencies)

        def pick(q: float) -> float:
            return round(data[min(len(data) - 1, int(q * len(data)))] * 1000, 3)

        return {"p50_ms": pick(0.5), "p90_ms": pick(0.9), "p99_ms": pick(0.99),
                "max_ms": round(data[-1] * 1000, 3)}
