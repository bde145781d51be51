"""The stats snapshot in the Prometheus text exposition format (version 0.0.4): what
``<mount>/.faultfs/metrics`` and ``--metrics-addr`` serve.

Every counter of the snapshot is a ``faultfs_<name>_total`` counter; store, memory, write
and shared-store figures are gauges; per-tag figures carry a ``tag`` label; fault latency
is a histogram (``faultfs_fault_latency_seconds``). Names are a public format: added, never
renamed (as the snapshot's keys).
"""

from __future__ import annotations

from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = (  # (metric, snapshot key, help)
    ("store_free_bytes", "store_free_bytes", "free bytes on the store's file system"),
    ("reserve_bytes", "reserve_bytes", "free-space reserve of the store"),
    ("cache_size_bytes", "cache_size", "cap of the store (0: none)"),
    ("cached_bytes", "cached_bytes", "bytes of clean blobs in the store"),
    ("memory_bytes", "memory_bytes", "bytes of blobs held in memory"),
    ("uptime_seconds", "uptime_s", "seconds since the mount started"),
    ("io_threads", "io_threads", "size of the I/O pool"),
)
_TAG_GAUGES = (
    ("tag_blobs", "blobs", "blobs of the tag's source"),
    ("tag_staged_blobs", "staged_blobs", "blobs of the tag in the local store"),
    ("tag_size_bytes", "view_size", "bytes of the tag's whole-object view"),
    ("tag_dirty_blobs", "dirty_blobs", "written blobs of the tag"),
    ("tag_dirty_bytes", "dirty_bytes", "bytes of written blobs of the tag"),
    ("tag_user_blobs", "user_blobs", "user blobs of the tag"),
    ("tag_damaged_blobs", "damaged_blobs", "damaged dirty blobs of the tag (EIO until a reset)"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return repr(float(value))


def render(snap: dict[str, Any]) -> str:
    out: list[str] = []

    def family(name: str, kind: str, text: str) -> None:
        out.append(f"# HELP faultfs_{name} {text}")
        out.append(f"# TYPE faultfs_{name} {kind}")

    for name, value in sorted(snap.get("counters", {}).items()):
        family(f"{name}_total", "counter", f"the {name.replace('_', ' ')} counter of the mount")
        out.append(f"faultfs_{name}_total {_num(value)}")
    for name, key, text in _GAUGES:
        if key in snap:
            family(name, "gauge", text)
            out.append(f"faultfs_{name} {_num(snap[key])}")
    family("store_degraded", "gauge", "1 when the store cannot be written")
    out.append(f"faultfs_store_degraded {_num(bool(snap.get('store_degraded')))}")
    writes = snap.get("writes", {})
    for name, key, text in (("writes_held_bytes", "held_bytes", "written bytes held in memory"),
                            ("journal_bytes", "journal_bytes", "bytes of the write journal")):
        if key in writes:
            family(name, "gauge", text)
            out.append(f"faultfs_{name} {_num(writes[key])}")
    shared = snap.get("shared") or {}
    if shared:
        family("shared_store_up", "gauge", "1 while the shared store answers")
        out.append(f'faultfs_shared_store_up{{url="{_label(str(shared.get("url", "")))}"}} '
                   f"{_num(bool(shared.get('up')))}")
        family("shared_publishes_pending", "gauge", "publishes to the shared store under way")
        out.append(f"faultfs_shared_publishes_pending {_num(shared.get('publishes_pending', 0))}")
    tags = snap.get("tags", {})
    for name, key, text in _TAG_GAUGES:
        family(name, "gauge", text)
        for tag, entry in sorted(tags.items()):
            value = entry.get(key, 0)
            value = len(value) if isinstance(value, list) else value  # names: how many
            out.append(f'faultfs_{name}{{tag="{_label(tag)}"}} {_num(value)}')
    hist = snap.get("fault_latency_histogram")
    if hist:
        family("fault_latency_seconds", "histogram", "time from a fault's start to its bytes")
        for le, count in zip(hist["le"], hist["counts"], strict=True):
            bound = le if isinstance(le, str) else repr(float(le))
            out.append(f'faultfs_fault_latency_seconds_bucket{{le="{bound}"}} {count}')
        out.append(f"faultfs_fault_latency_seconds_sum {_num(hist['sum'])}")
        out.append(f"faultfs_fault_latency_seconds_count {hist['count']}")
    return "\n".join(out) + "\n"
