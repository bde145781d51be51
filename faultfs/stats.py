"""Counters per stage of the fault path, and fault latency percentiles.

One ``Stats`` object is shared by the tiers and the engine of a mount; it is what
``.faultfs/stats`` and ``faultfs stat`` show under ``counters``. Counter names are fixed
(``COUNTERS``): adding to an unknown one is a bug, not a new counter.
"""

from __future__ import annotations

import collections
import time

LATENCY_SAMPLES = 2048  # fault latencies kept for percentiles

COUNTERS = (
    "reads", "hits", "faults", "fault_errors", "single_flight_joins", "source_reads",
    "source_bytes", "stored", "stored_bytes", "skipped_reserve", "skipped_no_store",
    "skipped_cache_cap", "store_failures", "readthrough_backoff", "evicted", "evicted_bytes",
    "zero_filled_bytes", "bytes_served", "page_reads", "page_slices", "page_errors",
    "stale_blobs_dropped", "corrupt_blobs_dropped", "memory_hits", "prefetches",
    "prefetch_errors", "store_readahead", "dirty_kept", "skipped_dirty", "skipped_degraded",
    "writes", "bytes_written", "fsyncs", "folds", "checkpoints",
    "shared_hits", "shared_misses", "shared_damaged", "shared_errors", "shared_skipped",
    "shared_publishes", "shared_publish_failures", "shared_publish_skipped",
    "shared_publish_dropped", "shared_bytes_in", "shared_bytes_out",
)


class Stats:
    """The counters and the most recent fault latencies."""

    def __init__(self) -> None:
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_SAMPLES)
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
