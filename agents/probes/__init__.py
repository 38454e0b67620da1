"""Ping-mesh probing: the echo responder every node runs and the prober that times it."""

from agents.probes.prober import PingProber, measure_overhead
from agents.probes.responder import DEFAULT_PROBE_PORT, UdpEchoResponder

__all__ = ["DEFAULT_PROBE_PORT", "PingProber", "UdpEchoResponder", "measure_overhead"]
