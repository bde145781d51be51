"""``faultfs checkpoint show FILE.meta``: decode a ping-pong checkpoint (streams, warm).

Invariants:
- ``checkpoint show`` never writes: it reads the 128-byte .meta (and the size of its WAL) and
  reports each slot as valid or why not, which slot recovery would pick, and the coordinate.
  An unrecoverable file is still described, then reported as a CorruptionError.
- A shuffled stream's state has a shuffle record beside it (``FILE.meta.shuffle``): its seed,
  window and shards, both slots, and the one that pairs with the active ``.meta`` slot (the
  epoch, window and position a resume continues at) are reported too, or that the ``.meta``
  is behind its record (a power loss; the next open writes it again), and a record that is
  damaged or does not pair makes the checkpoint unrecoverable, as a shuffled stream finds it.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING, Any

from faultfs.core.slots import SLOT_A_OFFSET, SLOT_B_OFFSET, SlotReading
from faultfs.errors import CorruptionError

if TYPE_CHECKING:
    from faultfs.store.metadata import Recovery


def register(subparsers: Any) -> None:
    """Add ``checkpoint show`` to an argparse subparsers object."""
    cp = subparsers.add_parser("checkpoint", help="inspect stream and warm checkpoints")
    cp_sub = cp.add_subparsers(dest="checkpoint_command", metavar="COMMAND")
    cp_sub.required = True
    show = cp_sub.add_parser(
        "show",
        help="decode both slots of a .meta file and its coordinate",
        description="Decode both slots of FILE.meta: valid or why not, which is active, and "
        "the coordinate to resume at. Exits non-zero if the file cannot be recovered.",
    )
    show.add_argument("file", metavar="FILE.meta")
    show.add_argument("--json", action="store_true", help="machine-readable output")
    show.set_defaults(func=cmd_checkpoint_show)


def _slot_dict(name: str, offset: int, reading: SlotReading) -> dict[str, Any]:
    d: dict[str, Any] = {"slot": name, "offset": offset, "status": reading.status.value}
    if reading.detail:
        d["detail"] = reading.detail
    if reading.slot is not None:
        d.update(
            epoch=reading.slot.epoch,
            committed_batch_id=reading.slot.committed_batch_id,
            dedup_count=reading.slot.dedup_count,
            coord=reading.slot.coord.as_dict(),
        )
    return d


def describe_checkpoint(path: str) -> tuple[dict[str, Any], CorruptionError | None]:
    """Everything ``checkpoint show`` reports, and the error if the file is unrecoverable."""
    from faultfs.store.metadata import HASH_SIZE, WAL_SUFFIX, choose_active, read_meta

    a, b = read_meta(path)
    info: dict[str, Any] = {
        "file": path,
        "slots": [_slot_dict("A", SLOT_A_OFFSET, a), _slot_dict("B", SLOT_B_OFFSET, b)],
    }
    error: CorruptionError | None = None
    recovery: Recovery | None = None
    try:
        recovery = choose_active(a, b)
    except CorruptionError as err:
        error = CorruptionError(f"{path}: {err.message}")
        info.update(active=None, recoverable=False, reason=err.message)
    if recovery is not None:
        info.update(
            active=recovery.active,
            recoverable=True,
            reason=recovery.reason,
            epoch=recovery.slot.epoch,
            committed_batch_id=recovery.slot.committed_batch_id,
            dedup_count=recovery.slot.dedup_count,
            coord=recovery.slot.coord.as_dict(),
        )
    wal = path + WAL_SUFFIX
    try:
        wal_size: int | None = os.stat(wal).st_size
    except FileNotFoundError:
        wal_size = None
    info["wal"] = {"file": wal, "size": wal_size}
    if recovery is not None:
        needed = recovery.slot.dedup_count * HASH_SIZE
        if wal_size is None and needed:
            wal_size = 0
        if wal_size is not None:
            info["wal"]["uncommitted_bytes"] = max(wal_size - needed, 0)
            if wal_size < needed:
                error = CorruptionError(
                    f"{wal}: dedup WAL is {wal_size} bytes but the checkpoint commits "
                    f"{recovery.slot.dedup_count} hashes ({needed} bytes)"
                )
                info["recoverable"] = False
                info["reason"] = error.message
    shuffle_error = _describe_shuffle(info, path, recovery)
    return info, error or shuffle_error


def _describe_shuffle(
    info: dict[str, Any], path: str, recovery: Recovery | None
) -> CorruptionError | None:
    """The shuffle record beside ``path``, if there is one, into ``info["shuffle"]``."""
    from faultfs.stream.shuffle import committed_pair, decode, read_record

    record = path + ".shuffle"
    data = read_record(record)
    if data is None:
        return None
    out: dict[str, Any] = {"file": record}
    info["shuffle"] = out
    try:
        header, slots = decode(data, record)
    except CorruptionError as err:
        out["error"] = err.message
        return err
    g = header.geometry
    out.update(seed=g.seed, block_bytes=g.block_bytes, window_blocks=g.window_blocks,
               shards=len(header.sizes), shard_bytes=sum(header.sizes))
    out["slots"] = [
        {"slot": name, "status": why} if slot is None else
        {"slot": name, "status": why, "meta_epoch": slot.meta_epoch, "epoch": slot.epoch,
         "window": slot.window, "position": slot.position, "dedup_base": slot.dedup_base,
         "generation": slot.generation, "finished": slot.finished}
        for name, (slot, why) in zip("AB", slots, strict=True)
    ]
    try:  # the record's newest slot is the checkpoint; its .meta may be behind it
        pair = committed_pair(path)
    except CorruptionError as err:
        out["error"] = err.message
        info["recoverable"] = False
        info["reason"] = err.message
        return err
    assert pair is not None
    meta, slot = pair
    out["active"] = "A" if slot.offset == 0 else "B"
    if recovery is None or meta.epoch != recovery.slot.epoch:
        out["note"] = (f"the .meta is behind its record, whose checkpoint is epoch {meta.epoch} "
                       f"(batch {meta.committed_batch_id}): the next open writes it again")
    return None


def _format(info: dict[str, Any]) -> str:
    lines = [f"checkpoint {info['file']}"]
    for s in info["slots"]:
        if s["status"] == "valid":
            state = (
                f"valid    epoch {s['epoch']}  batch {s['committed_batch_id']}  "
                f"dedup_count {s['dedup_count']}"
            )
        else:
            state = s["status"] + (f" ({s['detail']})" if "detail" in s else "")
        lines.append(f"  slot {s['slot']} @{s['offset']:<3} {state}")
    if info["recoverable"]:
        active = info["active"] or "none (fresh)"
        lines.append(f"  active: {active}: {info['reason']}")
        lines.append(
            f"  committed: epoch {info['epoch']}  batch {info['committed_batch_id']}  "
            f"dedup_count {info['dedup_count']}"
        )
        lines.append(
            "  coordinate: " + "  ".join(f"{k}={v}" for k, v in info["coord"].items())
        )
    else:
        lines.append(f"  active: none: UNRECOVERABLE: {info['reason']}")
    wal = info["wal"]
    if wal["size"] is None:
        lines.append(f"  dedup WAL: {wal['file']} (absent)")
    else:
        extra = (
            f", {wal['uncommitted_bytes']} uncommitted bytes" if "uncommitted_bytes" in wal else ""
        )
        lines.append(f"  dedup WAL: {wal['file']} {wal['size']} bytes{extra}")
    sh = info.get("shuffle")
    if sh is not None:
        if "seed" not in sh:
            lines.append(f"  shuffle record: {sh['file']}: {sh['error']}")
            return "\n".join(lines)
        lines.append(
            f"  shuffle record: {sh['file']}  seed {sh['seed']}  windows of "
            f"{sh['window_blocks']} x {sh['block_bytes']} bytes  {sh['shards']} shards, "
            f"{sh['shard_bytes']} bytes"
        )
        for s in sh["slots"]:
            if "epoch" in s:
                place = ("finished" if s["finished"]
                         else f"window {s['window']}  position {s['position']}")
                state = (f"valid    checkpoint epoch {s['meta_epoch']}  epoch {s['epoch']}  "
                         f"{place}  dedup_base {s['dedup_base']}  generation {s['generation']}")
            else:
                state = s["status"]
            lines.append(f"    slot {s['slot']} {state}")
        if "note" in sh:
            lines.append(f"    {sh['note']} (slot {sh['active']})")
        elif "active" in sh:
            lines.append(f"    pairs with the active checkpoint: slot {sh['active']}")
        elif "error" in sh:
            lines.append(f"    {sh['error']}")
    return "\n".join(lines)


def cmd_checkpoint_show(args: argparse.Namespace) -> int:
    info, error = describe_checkpoint(args.file)
    print(json.dumps(info, indent=2, sort_keys=True) if args.json else _format(info))
    if error is not None:
        raise error
    return 0
