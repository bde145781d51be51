"""A loopback HTTP/1.1 proxy that delays, paces and breaks responses, to emulate a remote source.

Public here: ``LatencyProxy`` (the proxy), ``FaultPlan`` and ``FaultRule`` (failures on
purpose), ``RequestRecord`` and ``LOG_LENGTH`` (what ``stats()`` logs), ``main`` (``python -m
faultfs.testing.proxy``). One duty a module: ``server`` (the face: life cycle, the loop
thread, accepting connections), ``connection`` (one client connection's requests relayed in
turn), ``response`` (one response and the fault that breaks it), ``http1`` (message framing),
``sockets`` (one socket's buffer and flow control), ``pacing`` (the bandwidth buckets),
``faults`` (rules, plans, error answers) and ``stats`` (the counters and the request log).
"""

from faultfs.testing.proxy.cli import main
from faultfs.testing.proxy.faults import FAULT_KINDS, FaultPlan, FaultRule
from faultfs.testing.proxy.server import LatencyProxy
from faultfs.testing.proxy.stats import LOG_LENGTH, RequestRecord

__all__ = [
    "FAULT_KINDS", "LOG_LENGTH", "FaultPlan", "FaultRule", "LatencyProxy", "RequestRecord", "main",
]
