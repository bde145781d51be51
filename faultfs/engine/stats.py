"""The engine's snapshot: everything ``faultfs stat`` and ``.faultfs/stats`` show, as plain
JSON-able values. The counters themselves are ``faultfs.stats.Stats``, shared with the tiers.

The document's keys are a public format (scripts and monitoring read it): keys are added,
never renamed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from faultfs import buffers
from faultfs.config import Config
from faultfs.engine.tags import Tag
from faultfs.engine.writes import Writes
from faultfs.stats import Stats
from faultfs.tiers.multilevel import TierStack


def snapshot(config: Config, store_root: str, store_free_bytes: int, stats: Stats,
             tiers: TierStack, tags: Iterable[Tag], writes: Writes,
             store_degraded: str = "") -> dict[str, Any]:
    policy = tiers.local.policy
    return {
        "pid": os.getpid(),
        "uptime_s": round(time.time() - stats.started, 1),
        "store": store_root,
        "store_free_bytes": store_free_bytes,
        "reserve_bytes": config.reserve_bytes,
        "store_enabled": config.store_enabled,
        "store_degraded": store_degraded,
        "cache_size": config.cache_size,
        "cached_bytes": policy.lru_bytes,
        "io_threads": config.io_threads,
        "xattrs": config.xattrs,
        "backoff_faults_left": policy.backoff_left,
        "memory_bytes": tiers.memory.size,
        # what is held for data against --memory-mb (tiers/budget.py): now and at most
        "data_budget": {"limit": tiers.budget.limit, "in_flight": tiers.budget.in_flight,
                        "outside_memory": tiers.budget.outside(), "peak": tiers.budget.peak,
                        "waits": tiers.budget.waits,
                        # of the memory tier: blobs prefetched that no reader read yet
                        "kept_ahead": tiers.ahead_bytes,
                        # prefetch runs that paused for the store writes until the bound
                        "store_pauses_cut": tiers.store_pauses_cut},
        "read_buffers": buffers.POOL.snapshot(),
        "counters": dict(stats.counters),
        "writes": {"writable": writes.writable, "held_bytes": writes.held,
                   "journal_bytes": writes.journal.bytes_on_disk},
        "fault_latency": stats.percentiles(),
        "fault_latency_histogram": stats.latencies.histogram(),
        "shared": _shared(tiers),
        "tags": {
            t.name: {
                "source": t.ctx.src, "key": t.key, "chunk_size": t.layout.chunk_size,
                "blobs": t.layout.num_blobs, "staged_blobs": tiers.local.staged_count(t.clean.id),
                "size": t.layout.size, "source_version": t.version_text,
                "stale_dropped_at_mount": t.stale_dropped, "source_error": t.source_error,
                "source_changed_at_mount": t.source_changed,
                "source_changed_under_mount": t.changed_under_mount,
                "shard": t.shard, "remote": t.remote, "view_name": t.view_name,
                "view_size": writes.view_size(t), **_dirty(writes, t),
            } for t in tags
        },
    }


def _shared(tiers: TierStack) -> dict[str, Any]:
    shared = tiers.shared
    if shared is None:
        return {}
    return {"url": shared.url, "up": shared.up, "publishes_pending": shared.pending,
            "publish_bytes_waiting": shared.waiting,
            "sealed": bool(getattr(shared.objects, "sealed", False)),
            "claims": "off" if shared.claims is None else shared.claims.mode}


def _dirty(writes: Writes, tag: Tag) -> dict[str, Any]:
    blobs, size = writes.dirty_summary(tag)
    return {"dirty_blobs": blobs, "dirty_bytes": size, "user_blobs": len(writes.user_names(tag)),
            "damaged_blobs": writes.damaged_names(tag)}
