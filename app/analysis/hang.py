"""Hang localisation: which node stopped a training job's collective.

When a collective hangs, the ranks that did reach it wait, and after the
process group's timeout their watchdogs report it (``nccl_timeout`` events
with the collective's sequence number, ``attrs.seq``). The fault is on a rank
that never reached that collective: one that reports a lower sequence number
(it is stuck in an earlier one) or one that reports nothing at all. Those
ranks are mapped to their nodes through the job's registered rank map
(``job_ranks``) and the nodes ranked with what else went wrong there in the
same window: an Xid, ping-mesh loss towards the node, a GPU gone from NVML.
When every rank waits at the same collective, the rank data names nobody and
only that corroborating evidence does.

The first part of this module is pure (``find_hangs``, ``rank_suspects``);
``HangDetector`` at the end reads the rows and writes the progress it saw.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.analysis.incidents import Report, SuspectOut

log = logging.getLogger(__name__)

# nccl_error reasons that are themselves a collective timeout (the watchdog
# terminating the process after one), so they start a hang as nccl_timeout does.
TIMEOUT_ERROR_REASONS = frozenset({"watchdog_terminated"})
DEFAULT_TIMEOUT_MS = 600_000  # torch.distributed's NCCL default


# -- inputs --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where one rank of a job runs."""

    rank: int
    node: str
    gpu: int | None = None


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return None


@dataclass(frozen=True)
class CollectiveReport:
    """One watchdog line of one rank, as ingest stored it (``events``)."""

    order: int  # the event's id: the order reports arrived in
    ts: datetime
    node: str
    job: str | None
    rank: int | None
    kind: str  # nccl_timeout | nccl_error
    seq: int | None = None
    op: str | None = None
    pg: str | None = None
    timeout_ms: int | None = None
    last_enqueued: int | None = None
    last_completed: int | None = None
    reason: str | None = None
    message: str = ""

    @classmethod
    def from_event(
        cls,
        order: int,
        ts: datetime,
        node: str,
        job: str | None,
        rank: int | None,
        kind: str,
        attrs: Mapping[str, Any],
        message: str = "",
    ) -> CollectiveReport:
        pg = attrs.get("pg")
        return cls(
            order=order,
            ts=ts,
            node=node,
            job=job,
            rank=rank,
            kind=kind,
            seq=_int(attrs.get("seq")),
            op=str(attrs["op"]) if attrs.get("op") is not None else None,
            pg=str(pg) if pg is not None else None,
            timeout_ms=_int(attrs.get("timeout_ms")),
            last_enqueued=_int(attrs.get("last_enqueued")),
            last_completed=_int(attrs.get("last_completed")),
            reason=attrs.get("reason"),
            message=message,
        )

    @property
    def is_timeout(self) -> bool:
        if self.kind == "nccl_timeout":
            return True
        return self.kind == "nccl_error" and self.reason in TIMEOUT_ERROR_REASONS

    @property
    def reached(self) -> int | None:
        """The furthest collective this line says the rank entered."""
        seen = [s for s in (self.seq, self.last_enqueued) if s is not None]
        return max(seen) if seen else None


@dataclass
class NodeEvidence:
    """What else the node showed in the hang's window."""

    xids: list[dict[str, Any]] = field(default_factory=list)
    gpu_lost: list[dict[str, Any]] = field(default_factory=list)
    probes_sent: int = 0
    probes_received: int = 0
    gpus_silent: list[int] = field(default_factory=list)  # GPUs whose NVML samples stopped


@dataclass(frozen=True)
class HangConfig:
    """Scores: a rank-level finding, plus corroboration on the node, capped at 1."""

    episode_gap_s: float = 300.0  # timeouts further apart than this are separate hangs
    behind_lowest: float = 0.6  # rank(s) at the lowest sequence number
    behind_other: float = 0.45  # behind the waited collective, but not the furthest
    silent: float = 0.4  # a mapped rank that reported nothing
    silent_beside_laggard: float = 0.25  # silent while another rank is known to be behind
    xid: float = 0.3
    gpu_lost: float = 0.35
    gpu_silent: float = 0.25
    ping_loss_base: float = 0.15
    ping_loss_per_ratio: float = 0.2
    ping_min_lost: int = 3
    ping_min_ratio: float = 0.02


# -- analysis ------------------------------------------------------------------------------------


@dataclass
class RankState:
    rank: int
    node: str
    gpu: int | None
    status: str  # waiting | behind | silent
    reached: int | None = None  # furthest sequence number reported
    behind_by: int | None = None
    last_report_at: datetime | None = None


@dataclass
class Hang:
    """One hang of one job: the collective the others wait in, and every rank's state."""

    job: str
    registered: bool
    key_seq: int | None  # the sequence number of the first timeout to arrive: a stable key
    waited_seq: int | None
    op: str | None
    pg: str | None
    timeout_ms: int | None
    first_seen: datetime
    last_seen: datetime
    ranks: list[RankState]
    reports: list[CollectiveReport]

    @property
    def key(self) -> str:
        return f"{self.job}:{self.key_seq if self.key_seq is not None else 'unknown'}"

    @property
    def behind(self) -> list[RankState]:
        return [r for r in self.ranks if r.status == "behind"]

    @property
    def silent(self) -> list[RankState]:
        return [r for r in self.ranks if r.status == "silent"]

    @property
    def nodes(self) -> list[str]:
        return sorted({r.node for r in self.ranks})


@dataclass
class NodeSuspect:
    node: str
    score: float
    ranks: list[int]
    reasons: list[str]
    evidence: dict[str, Any]


def _episodes(reports: Sequence[CollectiveReport], gap_s: float) -> list[list[CollectiveReport]]:
    """Split one job's reports into hangs: runs of timeouts no more than ``gap_s`` apart."""
    triggers = sorted((r for r in reports if r.is_timeout), key=lambda r: r.ts)
    spans: list[tuple[datetime, datetime]] = []
    for r in triggers:
        if spans and (r.ts - spans[-1][1]).total_seconds() <= gap_s:
            spans[-1] = (spans[-1][0], r.ts)
        else:
            spans.append((r.ts, r.ts))
    gap = timedelta(seconds=gap_s)
    out: list[list[CollectiveReport]] = [[] for _ in spans]
    for r in reports:
        for i, (start, end) in enumerate(spans):
            if start - gap <= r.ts <= end + gap:
                out[i].append(r)
                break
    return out


def find_hangs(
    job: str,
    placements: Sequence[Placement],
    reports: Iterable[CollectiveReport],
    config: HangConfig | None = None,
) -> list[Hang]:
    """Every hang of ``job`` in ``reports``, with each rank's state.

    ``placements`` is the job's registered rank map; empty for a job nobody
    registered, in which case ranks come from the reports and none can be
    known to be silent.
    """
    config = config or HangConfig()
    reports = [r for r in reports if r.rank is not None]
    hangs = []
    for episode in _episodes(reports, config.episode_gap_s):
        triggers = [r for r in episode if r.is_timeout]
        if not triggers:
            continue
        first = min(triggers, key=lambda r: r.order)
        key_trigger = (
            first
            if first.seq is not None
            else next(
                (r for r in sorted(triggers, key=lambda r: r.order) if r.seq is not None), first
            )
        )
        # Sequence numbers count per process group: compare ranks only within one.
        waited: dict[str | None, int] = {}
        for r in triggers:
            if r.seq is not None:
                waited[r.pg] = max(waited.get(r.pg, r.seq), r.seq)
        reached: dict[int, dict[str | None, int]] = defaultdict(dict)
        last_at: dict[int, datetime] = {}
        node_of: dict[int, str] = {}
        for r in episode:
            assert r.rank is not None
            node_of.setdefault(r.rank, r.node)
            last_at[r.rank] = max(last_at.get(r.rank, r.ts), r.ts)
            if r.reached is not None:
                per_pg = reached[r.rank]
                per_pg[r.pg] = max(per_pg.get(r.pg, r.reached), r.reached)
        mapped = {p.rank: p for p in placements}
        ranks = sorted(set(mapped) | set(node_of))
        states = []
        for rank in ranks:
            place = mapped.get(rank)
            node = place.node if place else node_of[rank]
            gpu = place.gpu if place else None
            if rank not in last_at:
                states.append(RankState(rank, node, gpu, "silent"))
                continue
            lag = 0
            for pg, seq in reached.get(rank, {}).items():
                if pg in waited and seq < waited[pg]:
                    lag = max(lag, waited[pg] - seq)
            furthest = max(reached[rank].values()) if reached.get(rank) else None
            states.append(
                RankState(
                    rank,
                    node,
                    gpu,
                    "behind" if lag else "waiting",
                    reached=furthest,
                    behind_by=lag or None,
                    last_report_at=last_at[rank],
                )
            )
        key_pg = key_trigger.pg
        waited_seq = waited.get(key_pg)
        op = next((r.op for r in triggers if r.pg == key_pg and r.seq == waited_seq and r.op), None)
        timeouts = [r.timeout_ms for r in triggers if r.timeout_ms]
        hangs.append(
            Hang(
                job=job,
                registered=bool(placements),
                key_seq=key_trigger.seq,
                waited_seq=waited_seq,
                op=op,
                pg=key_pg,
                timeout_ms=max(timeouts) if timeouts else None,
                first_seen=min(r.ts for r in triggers),
                last_seen=max(r.ts for r in episode),
                ranks=states,
                reports=sorted(episode, key=lambda r: r.order),
            )
        )
    return hangs


def candidate_nodes(hang: Hang) -> list[str]:
    """Nodes the rank data points at; every node of the job when it points at none."""
    named = {r.node for r in hang.ranks if r.status != "waiting"}
    return sorted(named) if named else hang.nodes


def rank_suspects(
    hang: Hang, evidence: Mapping[str, NodeEvidence], config: HangConfig | None = None
) -> list[NodeSuspect]:
    """Nodes ordered by how likely they stopped the collective; only nodes with a reason."""
    config = config or HangConfig()
    behind = hang.behind
    lowest = min((r.reached for r in behind if r.reached is not None), default=None)
    base: dict[str, float] = defaultdict(float)
    ranks: dict[str, list[int]] = defaultdict(list)
    reasons: dict[str, list[str]] = defaultdict(list)
    for r in hang.ranks:
        if r.status == "behind":
            score = config.behind_lowest if r.reached == lowest else config.behind_other
            why = (
                f"rank {r.rank} stopped at seq {r.reached}, {r.behind_by} behind"
                f" the collective seq {hang.waited_seq} the others wait in"
            )
        elif r.status == "silent":
            score = config.silent_beside_laggard if behind else config.silent
            why = f"rank {r.rank} reported nothing while the others timed out"
        else:
            continue
        base[r.node] = max(base[r.node], score)
        ranks[r.node].append(r.rank)
        reasons[r.node].append(why)
    gpus_of: dict[str, set[int]] = defaultdict(set)
    for r in hang.ranks:
        if r.gpu is not None:
            gpus_of[r.node].add(r.gpu)
    out = []
    for node in hang.nodes:
        ev = evidence.get(node, NodeEvidence())
        score = base.get(node, 0.0)
        details: dict[str, Any] = {}
        if ev.xids:
            score += config.xid
            xids = sorted({str(x["xid"]) for x in ev.xids if x.get("xid") is not None})
            reasons[node].append(f"Xid {', '.join(xids) or '?'} on the node")
            details["xid"] = ev.xids[:10]
        if ev.gpu_lost:
            score += config.gpu_lost
            reasons[node].append("a GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)")
            details["gpu_lost"] = ev.gpu_lost[:10]
        if ev.gpus_silent:
            mine = sorted(set(ev.gpus_silent) & gpus_of[node]) or sorted(ev.gpus_silent)
            score += config.gpu_silent
            reasons[node].append(f"NVML samples of GPU {', '.join(map(str, mine))} stopped")
            details["gpus_silent"] = sorted(ev.gpus_silent)
        if ev.probes_sent:
            lost = ev.probes_sent - ev.probes_received
            ratio = lost / ev.probes_sent
            details["ping"] = {"sent": ev.probes_sent, "received": ev.probes_received}
            if lost >= config.ping_min_lost and ratio >= config.ping_min_ratio:
                score += config.ping_loss_base + config.ping_loss_per_ratio * ratio
                reasons[node].append(f"ping-mesh: {lost} of {ev.probes_sent} probes to it lost")
        if score <= 0:
            continue
        out.append(
            NodeSuspect(
                node, round(min(score, 1.0), 3), sorted(ranks[node]), reasons[node], details
            )
        )
    out.sort(key=lambda s: (-s.score, -len(s.ranks), s.node))
    return out


def summarize(hang: Hang, suspects: Sequence[NodeSuspect]) -> str:
    where = f"collective seq {hang.waited_seq}" if hang.waited_seq is not None else "a collective"
    if hang.op:
        where += f" ({hang.op})"
    head = f"job {hang.job} hung in {where}"
    if not suspects:
        return head + ": every rank waits there; nothing on any node points at one"
    top = suspects[0]
    return f"{head}: node {top.node} suspected ({'; '.join(top.reasons[:3])})"


def assign_jobs(
    reports: Iterable[CollectiveReport], placements: Mapping[str, Sequence[Placement]]
) -> list[CollectiveReport]:
    """Give a job to reports of agents run without ``--job-id``.

    A report without a job belongs to the one registered job that places its
    rank on its node; with none or several, it stays without.
    """
    owners: dict[tuple[str, int], list[str]] = defaultdict(list)
    for job, places in placements.items():
        for p in places:
            owners[(p.node, p.rank)].append(job)
    out = []
    for r in reports:
        if r.job is None and r.rank is not None:
            jobs = owners.get((r.node, r.rank), [])
            if len(jobs) == 1:
                r = CollectiveReport(**{**r.__dict__, "job": jobs[0]})
        out.append(r)
    return out


def to_report(hang: Hang, suspects: Sequence[NodeSuspect]) -> Report:
    def rank_row(r: RankState) -> dict[str, Any]:
        return {
            "rank": r.rank,
            "node": r.node,
            "gpu": r.gpu,
            "reached_seq": r.reached,
            "behind_by": r.behind_by,
        }

    return Report(
        key=hang.key,
        kind="nccl-hang",
        suspects=[SuspectOut("node", s.node, s.score) for s in suspects],
        evidence={
            "job": hang.job,
            "registered": hang.registered,
            "waited_seq": hang.waited_seq,
            "op": hang.op,
            "pg": hang.pg,
            "timeout_ms": hang.timeout_ms,
            "ranks_total": len(hang.ranks),
            "ranks_waiting": sum(1 for r in hang.ranks if r.status == "waiting"),
            "behind_ranks": [rank_row(r) for r in hang.behind],
            "silent_ranks": [rank_row(r) for r in hang.silent][:256],
            "nodes": {
                s.node: {"score": s.score, "ranks": s.ranks, "reasons": s.reasons, **s.evidence}
                for s in suspects[:32]
            },
            "reports": [
                {
                    "ts": r.ts.isoformat(),
                    "node": r.node,
                    "rank": r.rank,
                    "kind": r.kind,
                    "seq": r.seq,
                    "message": r.message[:512],
                }
                for r in hang.reports[:32]
            ],
            "first_timeout": hang.first_seen.isoformat(),
            "last_report": hang.last_seen.isoformat(),
        },
        first_seen=hang.first_seen,
        summary=summarize(hang, suspects),
        severity="critical",
    )


# -- the engine's detector -----------------------------------------------------------------------


def _attrs(value: Any) -> dict[str, Any]:
    if isinstance(value, str):
        value = json.loads(value)
    return value if isinstance(value, dict) else {}


class HangDetector:
    """Training-job hangs from NCCL watchdog timeouts, localised to a node."""

    name = "hang"

    def __init__(
        self,
        config: HangConfig | None = None,
        window_s: float = 1800.0,
        max_lookback_s: float = 7200.0,
        probe_window_s: float = 120.0,
        gpu_stale_s: float = 15.0,
        settle_s: float = 1.0,
    ) -> None:
        self.config = config or HangConfig()
        # Every rank's watchdog fires within moments of the others, but their agents
        # ship up to a batch interval apart: judge a job only once the reports of
        # that second have landed, or the ranks still on their way look silent.
        self.settle_s = settle_s
        # A hang stays reported (its incident open) while its timeouts are this recent.
        self.window_s = window_s
        # The fault came up to one process-group timeout before the timeouts: look that far back.
        self.max_lookback_s = max_lookback_s
        self.probe_window_s = probe_window_s
        self.gpu_stale_s = gpu_stale_s

    async def _reports(self, conn: AsyncConnection, now: datetime) -> list[CollectiveReport]:
        rows = await conn.execute(
            text(
                "SELECT id, ts, node, job, rank, kind, attrs, message FROM events"
                " WHERE kind IN ('nccl_timeout', 'nccl_error') AND ts >= :since"
                " AND rank IS NOT NULL ORDER BY id LIMIT 100000"
            ),
            {"since": now - timedelta(seconds=self.window_s)},
        )
        return [
            CollectiveReport.from_event(i, ts, node, job, rank, kind, _attrs(attrs), message)
            for i, ts, node, job, rank, kind, attrs, message in rows
        ]

    async def _placements(
        self, conn: AsyncConnection, jobs: set[str], orphan_nodes: set[str]
    ) -> dict[str, list[Placement]]:
        if orphan_nodes:
            rows = await conn.execute(
                text(
                    "SELECT DISTINCT r.job FROM job_ranks r JOIN jobs j ON j.id = r.job"
                    " WHERE j.state = 'running' AND r.node = ANY(:nodes)"
                ),
                {"nodes": sorted(orphan_nodes)},
            )
            jobs = jobs | {r[0] for r in rows}
        if not jobs:
            return {}
        out: dict[str, list[Placement]] = defaultdict(list)
        rows = await conn.execute(
            text("SELECT job, rank, node, gpu FROM job_ranks WHERE job = ANY(:jobs)"),
            {"jobs": sorted(jobs)},
        )
        for job, rank, node, gpu in rows:
            out[job].append(Placement(rank, node, gpu))
        return out

    async def _evidence(
        self, conn: AsyncConnection, nodes: list[str], since: datetime, now: datetime
    ) -> dict[str, NodeEvidence]:
        out: dict[str, NodeEvidence] = {n: NodeEvidence() for n in nodes}
        rows = await conn.execute(
            text(
                "SELECT node, kind, ts, attrs, message FROM events"
                " WHERE kind IN ('xid', 'gpu_lost') AND ts >= :since AND node = ANY(:nodes)"
                " ORDER BY ts LIMIT 10000"
            ),
            {"since": since, "nodes": nodes},
        )
        for node, kind, ts, attrs, message in rows:
            a = _attrs(attrs)
            item = {"ts": ts.isoformat(), "message": message[:512]}
            if kind == "xid":
                item.update({"xid": a.get("xid"), "pci": a.get("pci")})
                out[node].xids.append(item)
            else:
                item.update({"gpu": a.get("gpu"), "pci": a.get("pci")})
                out[node].gpu_lost.append(item)
        probe_since = max(since, now - timedelta(seconds=self.probe_window_s))
        rows = await conn.execute(
            text(
                "SELECT dst, sum(sent), sum(received) FROM probe_stats"
                " WHERE ts >= :since AND dst = ANY(:nodes) GROUP BY dst"
            ),
            {"since": probe_since, "nodes": nodes},
        )
        for dst, sent, received in rows:
            out[dst].probes_sent = int(sent or 0)
            out[dst].probes_received = int(received or 0)
        rows = await conn.execute(
            text(
                "SELECT node, gpu, max(ts) FROM gpu_samples"
                " WHERE ts >= :since AND node = ANY(:nodes) GROUP BY node, gpu"
            ),
            {"since": since, "nodes": nodes},
        )
        stale_before = now - timedelta(seconds=self.gpu_stale_s)
        for node, gpu, last in rows:
            if last < stale_before:
                out[node].gpus_silent.append(int(gpu))
        return out

    async def _record_progress(self, conn: AsyncConnection, hangs: list[Hang]) -> None:
        """Keep each registered rank's furthest sequence number on ``job_ranks``."""
        rows = [
            (h.job, r.rank, r.reached, r.last_report_at)
            for h in hangs
            if h.registered
            for r in h.ranks
            if r.reached is not None and r.last_report_at is not None
        ]
        if not rows:
            return
        jobs, ranks, seqs, times = (list(col) for col in zip(*rows, strict=True))
        await conn.execute(
            text(
                "UPDATE job_ranks r SET last_seq = greatest(coalesce(r.last_seq, v.seq), v.seq),"
                " last_progress_at = greatest(coalesce(r.last_progress_at, v.at), v.at)"
                " FROM unnest(CAST(:jobs AS text[]), CAST(:ranks AS integer[]),"
                " CAST(:seqs AS bigint[]), CAST(:times AS timestamptz[])) AS v(job, rank, seq, at)"
                " WHERE r.job = v.job AND r.rank = v.rank"
                " AND (r.last_seq IS DISTINCT FROM greatest(coalesce(r.last_seq, v.seq), v.seq)"
                " OR r.last_progress_at IS DISTINCT FROM"
                " greatest(coalesce(r.last_progress_at, v.at), v.at))"
            ),
            {"jobs": jobs, "ranks": ranks, "seqs": seqs, "times": times},
        )

    async def evaluate(self, conn: AsyncConnection, now: datetime) -> list[Report]:
        reports = await self._reports(conn, now)
        if not any(r.is_timeout for r in reports):
            return []
        jobs = {r.job for r in reports if r.job is not None}
        orphan_nodes = {r.node for r in reports if r.job is None}
        placements = await self._placements(conn, jobs, orphan_nodes)
        by_job: dict[str, list[CollectiveReport]] = defaultdict(list)
        for r in assign_jobs(reports, placements):
            if r.job is not None:
                by_job[r.job].append(r)
        first_received = dict(
            (
                await conn.execute(
                    text(
                        "SELECT job, min(received_at) FROM events WHERE kind = 'nccl_timeout'"
                        " AND ts >= :since AND job = ANY(:jobs) GROUP BY job"
                    ),
                    {"since": now - timedelta(seconds=self.window_s), "jobs": sorted(by_job)},
                )
            ).all()
        )
        hangs = [
            h
            for job, job_reports in sorted(by_job.items())
            if (now - first_received.get(job, now - timedelta(days=1))).total_seconds()
            >= self.settle_s
            for h in find_hangs(job, placements.get(job, []), job_reports, self.config)
        ]
        out = []
        for hang in hangs:
            timeout_s = (hang.timeout_ms or DEFAULT_TIMEOUT_MS) / 1000.0
            since = max(
                hang.first_seen - timedelta(seconds=timeout_s + 60.0),
                now - timedelta(seconds=self.max_lookback_s),
            )
            nodes = candidate_nodes(hang)
            evidence = await self._evidence(conn, nodes, since, now)
            out.append(to_report(hang, rank_suspects(hang, evidence, self.config)))
        await self._record_progress(conn, hangs)
        return out
