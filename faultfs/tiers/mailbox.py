"""Who waits for whom: a node that waits on another node's claim tells it so through the
shared store, so a holder that held its publishes back (it looked alone: DESIGN §17,
``engine/heldback.py``) sends them at once.

A node's mailbox is the object ``claims/wanted/<node id>``; its body is canonical JSON,
``{"v":1,"wanted_ms":T}`` (wall clock of the last ring). A waiter rings each holder once (a
PUT); a holder with publishes held back looks at its own mailbox (a GET) every
``LOOK_S`` until it finds it rung. Once rung, or once it has waited on another node itself,
a node is *in company* for the rest of its life: it publishes at once, as before.

Invariants:
- Ringing and looking never fail a read: a failure of the store is logged and counted
  (``claim_errors``); a holder that cannot look publishes when its source reads are idle.
- A mailbox is never read past ``MAILBOX_MAX_BYTES``; a body that is not a mailbox still
  rings (anything at the key means someone waited). ``faultfs gc`` removes mailboxes rung
  longer ago than its grace, and any object under ``claims/wanted/`` that is not one.
"""

from __future__ import annotations

import json
import logging
import time

from faultfs.errors import CorruptionError
from faultfs.stats import Stats
from faultfs.tiers.claims import CLAIM_PREFIX, ClaimStore

log = logging.getLogger("faultfs.shared")

MAILBOX_PREFIX = f"{CLAIM_PREFIX}wanted/"
MAILBOX_VERSION = 1
MAILBOX_MAX_BYTES = 256


def mailbox_key(node: str) -> str:
    return f"{MAILBOX_PREFIX}{node}"


def encode_ring(now_ms: int) -> bytes:
    return json.dumps({"v": MAILBOX_VERSION, "wanted_ms": now_ms}, sort_keys=True,
                      separators=(",", ":")).encode()


def decode_ring(raw: bytes) -> int:
    """When the mailbox in ``raw`` was rung (ms); CorruptionError when it is not one."""
    try:
        d = json.loads(raw) if len(raw) <= MAILBOX_MAX_BYTES else None
    except (ValueError, UnicodeDecodeError):
        d = None
    if (not isinstance(d, dict) or set(d) != {"v", "wanted_ms"} or d["v"] != MAILBOX_VERSION
            or type(d["wanted_ms"]) is not int or d["wanted_ms"] < 0):
        raise CorruptionError("not a mailbox object")
    return d["wanted_ms"]


class Mailbox:
    """This node's side of the mailboxes (blocking calls: the claim board runs them on its
    threads)."""

    def __init__(self, store: ClaimStore, node: str, stats: Stats) -> None:
        self.store = store
        self.node = node
        self.stats = stats
        self.company = False  # another node waited on us, or we on another: publish at once
        self._rung: set[str] = set()

    def first(self, holder: str) -> bool:
        """Whether ``holder`` is to be rung (not yet, not this node); this node is in
        company from now on."""
        self.company = True
        if holder in self._rung or holder == self.node:
            return False
        self._rung.add(holder)
        return True

    def ring(self, holder: str) -> None:
        """Tell ``holder`` a node waits on its claim (blocking)."""
        try:
            self.store.put(mailbox_key(holder), encode_ring(int(time.time() * 1000)))
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("telling node %s that its blobs are awaited failed (%s)", holder,
                        exc.strerror or exc)

    def look(self) -> bool:
        """Whether this node's mailbox was rung (then it is in company from now on)."""
        if self.company:
            return True
        try:
            seen = self.store.read(mailbox_key(self.node))
        except OSError as exc:
            self.stats.add("claim_errors")
            log.warning("looking for nodes waiting on this one failed (%s)",
                        exc.strerror or exc)
            return False
        if seen is not None:
            self.company = True
            log.info("another node waits for blobs this node claimed: publishing at once")
        return self.company


def stale_mailbox(raw: bytes, cutoff_ms: int) -> bool:
    """Whether a mailbox object should go at a sweep: rung before ``cutoff_ms``, or not one."""
    try:
        return decode_ring(raw) < cutoff_ms
    except CorruptionError:
        return True
