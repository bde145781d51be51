"""The engine's snapshot: everything ``faultfs stat`` and ``.faultfs/stats`` show, as plain
JSON-able values. The counters themselves are ``faultfs.stats.Stats``, shared with the tiers.

The document's keys are a public format (scripts and monitoring read it): keys are added,
never renamed.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from faultfs import buffers

if TYPE_CHECKING:
    from faultfs.engine.engine import Engine


def snapshot(engine: Engine, store_free_bytes: int) -> dict[str, Any]:
    config = engine.config
    tiers = engine.tiers
    policy = tiers.local.policy
    return {
        "pid": os.getpid(),
        "uptime_s": round(time.time() - engine.stats.started, 1),
        "store": engine.store.root,
        "store_free_bytes": store_free_bytes,
        "reserve_bytes": config.reserve_bytes,
        "store_enabled": config.store_enabled,
        "cache_size": config.cache_size,
        "cached_bytes": policy.lru_bytes,
        "io_threads": config.io_threads,
        "backoff_faults_left": policy.backoff_left,
        "memory_bytes": tiers.memory.size,
        "read_buffers": buffers.POOL.snapshot(),
        "counters": dict(engine.stats.counters),
        "fault_latency": engine.stats.percentiles(),
        "tags": {
            t.name: {
                "source": t.ctx.src, "key": t.key, "chunk_size": t.layout.chunk_size,
                "blobs": t.layout.num_blobs, "staged_blobs": engine.staged_count(t),
                "size": t.layout.size, "source_version": t.version_text,
                "stale_dropped_at_mount": t.stale_dropped, "source_error": t.source_error,
                "source_changed_at_mount": t.source_changed,
                "shard": t.shard, "remote": t.remote,
            } for t in engine.tags.values()
        },
    }
