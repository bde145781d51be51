"""``faultfs warm MNT[/TAG]``: eager, resumable ingest of a mount or one tag (``faultfs.warm``)."""

from __future__ import annotations

import argparse
import sys

from faultfs.errors import InvalidInput
from faultfs.warm import CHECKPOINT_BLOBS, CHECKPOINT_SECONDS, default_state_path, warm


def register(subparsers) -> None:
    w = subparsers.add_parser(
        "warm",
        help="eagerly ingest a mount or one tag (resumable, with a progress bar)",
        description=(
            "Read every blob of MNT (all tags) or MNT/TAG that is not yet staged, so later reads "
            "are hits. Progress is checkpointed; an interrupted warm resumes where it stopped."
        ),
    )
    w.add_argument("target", metavar="MNT[/TAG]", help="a faultfs mount root or tag directory")
    w.add_argument(
        "--state",
        metavar="FILE.meta",
        help="checkpoint file (default: <store>/warm/<hash of target>.meta)",
    )
    w.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    w.add_argument(
        "--checkpoint-every",
        type=int,
        default=CHECKPOINT_BLOBS,
        metavar="N",
        help=f"checkpoint every N blobs (default {CHECKPOINT_BLOBS}; also every "
        f"{CHECKPOINT_SECONDS:g} s)",
    )
    w.set_defaults(func=cmd_warm)


def cmd_warm(args: argparse.Namespace) -> int:
    if args.checkpoint_every < 1:
        raise InvalidInput(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    state = args.state or default_state_path(args.target)
    report = warm(
        args.target,
        state,
        progress=not args.no_progress,
        checkpoint_blobs=args.checkpoint_every,
    )
    for note in report.notes:
        print(f"warm: {note}", file=sys.stderr)
    resumed = ""
    if report.resumed_from is not None:
        resumed = (
            f", resumed at tag {report.resumed_from.shard_id} "
            f"blob {report.resumed_from.byte_offset}"
        )
    print(
        f"warmed {report.blobs_warmed} blobs ({report.bytes_read} bytes), "
        f"{report.blobs_skipped} already staged, {report.tags} tags in "
        f"{report.seconds:.1f}s{resumed}; checkpoint {report.state_path}"
    )
    return 0
