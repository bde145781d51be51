"""Faults on purpose: the rules and plan that pick which requests break, and the error answers.

Invariants:
- Faults are decided when a request head arrives, from generators seeded by the plan, so one
  plan over one sequence of requests breaks the same requests every run.
- Every rule counts and draws for each request it matches, whether or not an earlier rule
  took that request, so adding a rule does not shift another's hits.
- A plan holds no state: each plan put in use (``Faults.use``) starts its counts and
  generators afresh, and is swapped whole, so a pick sees one plan.
"""

from __future__ import annotations

import http
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from xml.sax.saxutils import escape

FAULT_KINDS = ("reset", "stall", "status", "truncate")
S3_ERROR_CODES = {
    400: "BadRequest",
    403: "AccessDenied",
    404: "NoSuchKey",
    500: "InternalError",
    502: "BadGateway",
    503: "ServiceUnavailable",
}
S3_ERROR_MESSAGES = {
    500: "We encountered an internal error. Please try again.",
    503: "Please reduce your request rate.",
}


@dataclass(frozen=True)
class FaultRule:
    """One fault and the requests it hits.

    ``kind``: ``"reset"`` closes the client connection abruptly (RST) once ``after_bytes`` of the
    response body went out; ``"stall"`` stops sending there for ``stall_s`` seconds (``None``:
    until the client or the proxy closes), the connection kept open; ``"status"`` answers
    ``status`` with a small S3-style XML error (``code``, ``message``; defaults follow the
    status) without asking the upstream; ``"truncate"`` sends the real head, then closes after
    half the body (a chunked body: everything but its last chunk).

    ``after_bytes`` counts body bytes as sent (a chunked body's framing too); ``None`` means
    before the response head (a reset then answers nothing, though the upstream saw the
    request). A body shorter than ``after_bytes`` gets the fault at its end.

    Which requests: those numbered in ``requests`` (1 is the first request the rule matches),
    and each other one with probability ``fraction``. ``match(method, path)``, if given, picks
    the requests the rule sees at all; ``path`` is the request target as sent, query included.
    """

    kind: str
    requests: Iterable[int] = ()
    fraction: float = 0.0
    match: Callable[[str, str], bool] | None = None
    after_bytes: int | None = 0
    stall_s: float | None = None
    status: int = 503
    code: str | None = None
    message: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {self.kind!r} is not one of {FAULT_KINDS}")
        numbers = frozenset(self.requests)
        if any(n < 1 for n in numbers):
            raise ValueError("request numbers count from 1")
        object.__setattr__(self, "requests", numbers)
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("fraction must be within [0, 1]")
        if self.after_bytes is not None and self.after_bytes < 0:
            raise ValueError("after_bytes must be >= 0 or None")
        if self.stall_s is not None and self.stall_s < 0:
            raise ValueError("stall_s must be >= 0 or None")
        if not 400 <= self.status <= 599:
            raise ValueError("an injected status is an error: 400 to 599")


class FaultPlan:
    """Rules tried in order; the first that hits a request breaks it.

    Every rule counts and draws for each request it matches, whether or not an earlier rule
    took that request, so adding a rule does not shift another's hits. ``seed`` seeds one
    generator per rule. The plan itself holds no state: each ``set_faults`` (or proxy) starts
    its counts and generators afresh.
    """

    def __init__(self, *rules: FaultRule, seed: int = 0) -> None:
        for rule in rules:
            if not isinstance(rule, FaultRule):
                raise TypeError(f"FaultPlan takes FaultRule objects, not {rule!r}")
        self.rules = rules
        self.seed = seed

    def __repr__(self) -> str:
        return f"FaultPlan({', '.join(map(repr, self.rules))}, seed={self.seed})"


class FaultPicker:
    """A plan in use: how many requests each rule has matched, and each rule's generator."""

    def __init__(self, plan: FaultPlan) -> None:
        self.rules = plan.rules
        self.matched = [0] * len(plan.rules)
        # a str seed is hashed with SHA-512, so it is the same in every process
        self.draws = [random.Random(f"{plan.seed}:{i}") for i in range(len(plan.rules))]

    def pick(self, method: str, path: str) -> FaultRule | None:
        chosen = None
        for i, rule in enumerate(self.rules):
            if rule.match is not None and not rule.match(method, path):
                continue
            self.matched[i] += 1
            hit = self.matched[i] in rule.requests
            if rule.fraction and self.draws[i].random() < rule.fraction:
                hit = True
            if hit and chosen is None:
                chosen = rule
        return chosen


class Faults:
    """The plan a proxy uses now (None: no faults)."""

    def __init__(self, plan: FaultPlan | None) -> None:
        self.use(plan)

    def use(self, plan: FaultPlan | None) -> None:
        """Install ``plan`` (counting requests from 1 again), or ``None`` for no faults."""
        self._picker = FaultPicker(plan) if plan is not None else None

    def pick(self, method: str, path: str) -> FaultRule | None:
        """The rule that breaks this request, if any."""
        picker = self._picker
        return picker.pick(method, path) if picker is not None else None


def error_answer(status: int, code: str | None, message: str | None, request_id: str,
                 close: bool) -> tuple[bytes, bytes]:
    """The head and body of an S3-style XML error answer."""
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    code = code or S3_ERROR_CODES.get(status) or phrase.replace(" ", "")
    message = message or S3_ERROR_MESSAGES.get(status) or phrase
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{escape(code)}</Code><Message>{escape(message)}</Message>"
        f"<RequestId>{escape(request_id)}</RequestId></Error>"
    ).encode()
    head = (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "Content-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"x-amz-request-id: {request_id}\r\n"
        + ("Connection: close\r\n" if close else "")
        + "\r\n"
    ).encode()
    return head, body
