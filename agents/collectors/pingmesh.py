"""Ping-mesh collector: hands the prober's finished per-second stats to the shipper."""

from __future__ import annotations

from typing import ClassVar

from agents.collectors.base import Collector, Samples
from agents.probes.prober import PingProber
from agents.probes.responder import UdpEchoResponder


class PingmeshCollector(Collector):
    """Wraps a ``PingProber`` (and optionally this node's ``UdpEchoResponder``).

    The prober runs on its own schedule; ``collect()`` only drains what it
    has finished, so a slow collection cycle delays reports, never probes.
    The prober (and responder) start on the first ``collect()`` if the agent
    has not started them already, and stop on ``close()``.
    """

    name: ClassVar[str] = "pingmesh"

    def __init__(self, prober: PingProber, responder: UdpEchoResponder | None = None) -> None:
        self.prober = prober
        self.responder = responder

    async def collect(self) -> Samples:
        if self.responder is not None and not self.responder.running:
            await self.responder.start()
        if not self.prober.running:
            await self.prober.start()
        return Samples(probes=self.prober.drain())

    async def close(self) -> None:
        await self.prober.stop()
        if self.responder is not None:
            await self.responder.stop()
