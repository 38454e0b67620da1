"""The engine's detectors: each reads its recent rows from PostgreSQL and
hands them to the pure analysis module of its fault (pingmesh, pfc, ...),
then turns that module's findings into ``Report``s."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.analysis.incidents import Report, SuspectOut
from app.analysis.pfc import PfcStormConfig, PfcStormDetector, samples_from_counter_rates
from app.analysis.pingmesh import LocalizerConfig, PairStat, PingmeshLocalizer
from app.analysis.stragglers import StragglerConfig, StragglerDetector, StragglerFinding
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


class StragglersDetector:
    """Persistently slow ranks of training jobs, from their step times, named by node.

    Each cycle feeds the step rows received since the last one (``job_steps``,
    ranks placed on nodes through ``job_ranks``) to the pure
    ``StragglerDetector``. Only when it finds a straggler are the GPU samples
    and ping-mesh RTTs of that job's nodes read, for its corroboration hints:
    a cycle without a straggler costs one indexed read.
    """

    name = "stragglers"

    def __init__(
        self,
        config: StragglerConfig | None = None,
        settle_s: float = 2.0,
        lookback_s: float = 900.0,
        hold_s: float = 60.0,
        batch_rows: int = 200_000,
    ) -> None:
        self.detector = StragglerDetector(config)
        # Rows are read once, by received_at in [lo, hi) with hi this far behind the
        # database clock: an insert still committing carries an earlier received_at
        # (its transaction's start) and must land in a later window, not be skipped.
        self.settle_s = settle_s
        # After a restart the in-memory state is rebuilt from this much history.
        self.lookback_s = lookback_s
        # The persistence test is a threshold on a sliding window: a rank slow in
        # about 80 % of its steps crosses it back and forth. A finding stays
        # reported this long after it was last made, so its incident does not flap.
        self.hold_s = hold_s
        self.batch_rows = batch_rows
        self._received_lo: datetime | None = None
        self._gpu_since: dict[str, datetime] = {}
        self._rtt_since: dict[str, datetime] = {}
        self._held: dict[str, tuple[datetime, Report]] = {}

    async def _read_steps(self, conn: AsyncConnection) -> None:
        db_now = (await conn.execute(text("SELECT clock_timestamp()"))).scalar_one()
        hi = db_now - timedelta(seconds=self.settle_s)
        lo = self._received_lo or db_now - timedelta(seconds=self.lookback_s)
        if lo >= hi:
            return
        rows = (
            await conn.execute(
                text(
                    "SELECT s.job, s.rank, r.node, s.step, s.duration_s, s.ts, s.received_at"
                    " FROM job_steps s JOIN job_ranks r ON r.job = s.job AND r.rank = s.rank"
                    " WHERE s.received_at >= :lo AND s.received_at < :hi"
                    " ORDER BY s.received_at LIMIT :n"
                ),
                {"lo": lo, "hi": hi, "n": self.batch_rows},
            )
        ).all()
        if len(rows) == self.batch_rows and rows[-1].received_at > lo:
            # A backlog: stop before the last instant read (it may go on past the
            # limit) and take that instant whole next cycle.
            hi = rows[-1].received_at
            rows = [r for r in rows if r.received_at < hi]
        for job, rank, node, step, duration_s, ts, _ in rows:
            self.detector.observe_step(job, rank, node, step, duration_s, ts.timestamp())
        self._received_lo = hi

    async def _job_nodes(self, conn: AsyncConnection, jobs: list[str]) -> list[str]:
        rows = await conn.execute(
            text("SELECT DISTINCT node FROM job_ranks WHERE job = ANY(:jobs) ORDER BY node"),
            {"jobs": jobs},
        )
        return [r[0] for r in rows]

    async def _read_hints(self, conn: AsyncConnection, nodes: list[str], now: datetime) -> None:
        """Feed the GPU samples and RTTs of ``nodes`` not fed yet, within the hint window."""
        oldest = now - timedelta(seconds=self.detector.config.hint_window_s)
        since = [max(self._gpu_since.get(n, oldest), oldest) for n in nodes]
        rows = await conn.execute(
            text(
                "SELECT g.node, g.ts, g.gpu, g.sm_clock_mhz, g.throttle_reasons"
                " FROM gpu_samples g JOIN unnest(CAST(:nodes AS text[]),"
                " CAST(:since AS timestamptz[])) AS w(node, since)"
                " ON g.node = w.node AND g.ts > w.since"
                " WHERE g.ts > :oldest AND g.ts <= :now ORDER BY g.ts"
            ),
            {"nodes": nodes, "since": since, "oldest": oldest, "now": now},
        )
        for node, ts, gpu, clock, reasons in rows:
            self.detector.observe_gpu(node, ts.timestamp(), clock, reasons, gpu)
            self._gpu_since[node] = ts
        # One figure per node and whole second (the median over its peers' probes),
        # and only seconds whose probe rows have all arrived.
        upto = (now - timedelta(seconds=2)).replace(microsecond=0)
        since = [max(self._rtt_since.get(n, oldest), oldest) for n in nodes]
        rows = await conn.execute(
            text(
                "SELECT p.dst, date_trunc('second', p.ts) AS sec,"
                " percentile_cont(0.5) WITHIN GROUP (ORDER BY p.rtt_p50_us)"
                " FROM probe_stats p JOIN unnest(CAST(:nodes AS text[]),"
                " CAST(:since AS timestamptz[])) AS w(node, since)"
                " ON p.dst = w.node AND p.ts >= w.since"
                " WHERE p.ts >= :oldest AND p.ts < :upto AND p.rtt_p50_us IS NOT NULL"
                " GROUP BY p.dst, sec"
            ),
            {"nodes": nodes, "since": since, "oldest": oldest, "upto": upto},
        )
        for node, sec, rtt in rows:
            self.detector.observe_rtt(node, sec.timestamp(), rtt)
        for node in nodes:
            self._rtt_since[node] = upto

    async def evaluate(self, conn: AsyncConnection, now: datetime) -> list[Report]:
        await self._read_steps(conn)
        findings = self.detector.evaluate(now.timestamp())
        if findings:
            nodes = await self._job_nodes(conn, sorted({f.job for f in findings}))
            await self._read_hints(conn, nodes, now)
            # Judged again with the hints fed; the verdicts do not change.
            findings = self.detector.evaluate(now.timestamp())
        reports = [straggler_report(f) for f in findings]
        for r in reports:
            self._held[r.key] = (now, r)
        found = {r.key for r in reports}
        for key, (at, held) in list(self._held.items()):
            if key in found:
                continue
            if (now - at).total_seconds() > self.hold_s:
                del self._held[key]
            else:
                reports.append(held)
        return reports


def straggler_report(f: StragglerFinding) -> Report:
    """A straggler finding as the engine's report: the node is the suspect."""
    hints = f.evidence.get("hints") or []
    ranks = ", ".join(str(r) for r in f.ranks[:8]) + (", ..." if len(f.ranks) > 8 else "")
    return Report(
        key=f"{f.job}:{f.node}",
        kind="straggler",
        # A slow node with a throttling GPU or a slow link is a fault; without
        # either it may be the job's own imbalance (data, pipeline stage).
        suspects=[SuspectOut("node", f.node, 0.9 if f.corroborated else 0.6)],
        evidence={
            "job": f.job,
            "node": f.node,
            "ranks": f.ranks,
            "slowdown": f.slowdown,
            "z": f.z,
            **f.evidence,
        },
        first_seen=datetime.fromtimestamp(f.first_seen, UTC),
        summary=f"straggler: {f.node} (ranks {ranks} of job {f.job}) is {f.slowdown:.0%} slower"
        " than its peers" + (f"; {hints[0]}" if hints else ""),
        severity="warning",
    )
