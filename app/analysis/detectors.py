"""The engine's detectors: each reads its recent rows from PostgreSQL and
hands them to the pure analysis module of its fault (pingmesh, pfc, ...),
then turns that module's findings into ``Report``s."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.analysis.incidents import Report, SuspectOut
from app.analysis.pfc import PfcStormConfig, PfcStormDetector, samples_from_counter_rates
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


# Pause counters arrive four times a second from the frame sniffer (once from
# ethtool): a port pausing for one whole second is a storm, which lets the
# source be named about two seconds after the storm starts.
PFC_DEFAULTS = PfcStormConfig(detection_window_s=1.0, sample_period_s=0.25)


class PfcDetector:
    """PFC storms: a port sending pause frames without end, and its victims."""

    name = "pfc"
    # Only counters that say something about pauses reach the detector.
    COUNTER_PATTERN = "(rx|tx)_(prio[0-7]_)?pause(_duration)?|pfc_frames_prio[0-7]"

    def __init__(self, config: PfcStormConfig | None = None, lookback_s: float = 10.0) -> None:
        self.detector = PfcStormDetector(config or PFC_DEFAULTS)
        self.lookback_s = lookback_s

    async def evaluate(self, conn: AsyncConnection, now: datetime) -> list[Report]:
        rows = await conn.execute(
            text(
                "SELECT node, iface, ts, counter, rate FROM nic_counters"
                " WHERE ts >= :since AND counter ~ :pattern ORDER BY ts"
            ),
            {
                "since": now - timedelta(seconds=self.lookback_s),
                "pattern": f"^({self.COUNTER_PATTERN})$",
            },
        )
        by_reading: dict[tuple[str, str, datetime], dict[str, float | None]] = {}
        for node, iface, ts, counter, rate in rows:
            by_reading.setdefault((node, iface, ts), {})[counter] = rate
        for (node, iface, ts), rates in by_reading.items():
            self.detector.observe_many(samples_from_counter_rates(node, iface, ts, rates))
        reports = []
        for f in self.detector.evaluate(now):
            if f.state != "storm":
                continue  # a restored port stops being reported; its incident closes
            prio = "link" if f.priority is None else f"prio{f.priority}"
            suspects = [SuspectOut("node", f.node, 0.95)]
            suspects += [SuspectOut("victim", f"{v.node}/{v.iface}", 0.1) for v in f.victims]
            reports.append(
                Report(
                    key=f"{f.node}:{f.iface}:{prio}",
                    kind="pfc-storm",
                    suspects=suspects,
                    evidence={
                        "source": {"node": f.node, "iface": f.iface, "priority": f.priority},
                        "victims": [dataclasses.asdict(v) for v in f.victims],
                        "detected_at": f.detected_at.isoformat(),
                        **f.evidence,
                    },
                    first_seen=f.first_seen,
                    summary=f"pfc-storm: {f.node} {f.iface} {prio} is sending pause frames"
                    f" without end ({len(f.victims)} victims)",
                    severity="critical",
                )
            )
        return reports
