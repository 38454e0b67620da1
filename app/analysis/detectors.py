"""The engine's detectors: each reads its recent rows from PostgreSQL and
hands them to the pure analysis module of its fault (pingmesh, pfc, ...),
then turns that module's findings into ``Report``s."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.analysis.incidents import Report, SuspectOut
from app.analysis.pingmesh import LocalizerConfig, PairStat, PingmeshLocalizer
from app.analysis.topology import Topology

UNRACKED = "unracked"

_SEVERITY = {
    "node-unreachable": "critical",
    "tor-down": "critical",
    "uplink-down": "critical",
    "path-loss": "warning",
    "latency-degradation": "warning",
}


async def load_topology(conn: AsyncConnection) -> Topology:
    rows = await conn.execute(text("SELECT id, rack, pod, address, probe_port FROM nodes"))
    return Topology.from_records((n, rack or UNRACKED, pod, a, p) for n, rack, pod, a, p in rows)


# Latency alarms must outlast scheduler noise on busy hosts: a p50 that rises by
# 2 ms and triples for 5 s is congestion or a bad link, a 300 us blip is not.
PINGMESH_DEFAULTS = LocalizerConfig(
    latency_factor=3.0, latency_floor_us=2000.0, latency_confirm_s=5.0
)


class PingmeshDetector:
    """Network faults from the ping-mesh: node, ToR, uplink, path, latency."""

    name = "pingmesh"

    def __init__(self, config: LocalizerConfig | None = None, lag_s: float = 2.0) -> None:
        self.localizer = PingmeshLocalizer(config or PINGMESH_DEFAULTS)
        # Probe rows arrive up to a probe timeout plus a batch interval after their second.
        self.lag_s = lag_s

    async def evaluate(self, conn: AsyncConnection, now: datetime) -> list[Report]:
        topology = await load_topology(conn)
        if len(topology) < 2:
            return []
        since = now - timedelta(seconds=self.localizer.config.window_s + self.lag_s)
        rows = await conn.execute(
            text(
                "SELECT src, dst, flow, sum(sent), sum(received),"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY rtt_p50_us), max(ts)"
                " FROM probe_stats WHERE ts >= :since GROUP BY src, dst, flow"
            ),
            {"since": since},
        )
        stats = [
            PairStat(s, d, f, int(sent), int(recv), rtt, ts)
            for s, d, f, sent, recv, rtt, ts in rows
        ]
        if not stats:
            return []
        findings = self.localizer.evaluate(topology, stats)
        return [
            Report(
                key=f.key,
                kind=f.kind,
                suspects=[SuspectOut(s.type, s.id, round(s.score, 3)) for s in f.suspects],
                evidence={
                    "failing_pairs": f.failing_pairs,
                    "healthy_pairs_through_suspect": f.healthy_pairs,
                    "pairs": [dataclasses.asdict(p) for p in f.evidence],
                    "last_seen": f.last_seen.isoformat(),
                },
                first_seen=f.first_seen,
                summary=f.summary(),
                severity=_SEVERITY.get(f.kind, "error"),
            )
            for f in findings
        ]
