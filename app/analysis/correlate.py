"""The correlator: one incident per fault, however many detectors saw it.

A dead GPU shows up several ways at once: an Xid 79 in the node's kernel log,
NCCL watchdog timeouts on every other rank of the job, ping-mesh loss to the
node. Each source alone is one *signal*: a suspect (node, ToR, uplink, path,
job), a score in [0, 1], and whether it is *strong* on its own (a critical Xid,
a lost GPU, a critical detector finding at a high score). The correlator runs
as the engine's last detector; every cycle it

1. reads the signals of the last ``window_s`` seconds: the open incidents of
   the other detectors, and the Xid / lost-GPU / NCCL events of the agents;
2. groups them by root-cause suspect (the top suspect of each signal), so the
   same fault reported by three sources becomes one report keyed by suspect,
   which is what deduplicates it across sources and across cycles;
3. scores each group by noisy-or over its sources (each source counts once,
   at its best score) and calls it strong when one signal is strong or two
   independent sources agree: the isolation policy never acts on less;
4. reports the groups as incidents (detector ``correlator``); a group whose
   signals have all aged out of the window is not reported, and the incident
   store closes it: the suspects are healthy again.

NCCL timeouts name the ranks that waited, not the one that hung. The missing
ranks of a job (and ranks stuck at an older collective) are placed on nodes
through the job's rank layout: each node holds a contiguous block of ranks,
so a rank missing from a node's block is that node's.

Actions and alerts act on correlated incidents only; the detectors' own
incidents stay visible as the evidence they are.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.analysis.incidents import Report, SuspectOut

DETECTOR_NAME = "correlator"

SEVERITY_RANK = {"info": 0, "warning": 1, "error": 2, "critical": 3}

# Detectors that watch the same thing as an event family count as one source.
_SOURCE_OF_DETECTOR = {"hang": "nccl", "gpu": "gpu", "xid": "gpu"}

# Event signals: (kind of the correlated incident, score, strong) by event kind/severity.
_XID_SIGNAL = {
    "critical": ("gpu-fault", 0.9, True),
    "error": ("gpu-fault", 0.6, False),
    "warning": ("gpu-fault", 0.3, False),
}
_GPU_LOST_SIGNAL = ("gpu-lost", 0.95, True)
NCCL_NODE_SCORE = 0.5
NCCL_JOB_SCORE = 0.3
STRONG_SCORE = 0.8
# An NCCL hang no other source localises becomes its own (job) incident only
# after this long: the watchdogs of a job fire within seconds of each other,
# and the Xid or ping-mesh loss that names the node is usually already there.
JOB_CONFIRM_S = 5.0
MAX_SAMPLES = 5


@dataclass(frozen=True)
class Signal:
    """One source's say about one suspect."""

    source: str
    suspect_type: str
    suspect: str
    kind: str
    score: float
    strong: bool
    severity: str
    ts: datetime
    evidence: dict[str, Any]
    member: int | None = None  # the detector incident this came from
    others: tuple[SuspectOut, ...] = ()  # lower-ranked suspects of that incident


@dataclass
class _Group:
    suspect_type: str
    suspect: str
    signals: list[Signal] = field(default_factory=list)
    corroboration: list[dict[str, Any]] = field(default_factory=list)


def combined_score(signals: Iterable[Signal]) -> float:
    """Noisy-or over sources, each source at its best score."""
    best: dict[str, float] = {}
    for s in signals:
        best[s.source] = max(best.get(s.source, 0.0), s.score)
    miss = 1.0
    for score in best.values():
        miss *= 1.0 - min(max(score, 0.0), 1.0)
    return 1.0 - miss


def correlate(
    signals: Sequence[Signal],
    unlocalized: Sequence[dict[str, Any]] = (),
    now: datetime | None = None,
    job_confirm_s: float = JOB_CONFIRM_S,
) -> list[Report]:
    """Group signals by root-cause suspect into reports. Pure: no I/O.

    ``unlocalized`` are job-level NCCL findings that name no node: they are
    attached as corroboration to node groups whose node is not among the
    job's reporting nodes, and otherwise reported on their own once older
    than ``job_confirm_s`` (other sources usually name the node first).
    """
    groups: dict[str, _Group] = {}
    for s in signals:
        key = f"{s.suspect_type}:{s.suspect}"
        groups.setdefault(key, _Group(s.suspect_type, s.suspect)).signals.append(s)
    for job in unlocalized:
        hosts = [
            g
            for g in groups.values()
            if g.suspect_type == "node" and g.suspect not in job["reporting_nodes"]
        ]
        for g in hosts:
            g.corroboration.append(job)
        young = now is not None and (now - job["first_seen"]).total_seconds() < job_confirm_s
        if not hosts and not young:
            sig = Signal(
                source="nccl",
                suspect_type="job",
                suspect=job["job"],
                kind=job["kind"],
                score=NCCL_JOB_SCORE,
                strong=False,
                severity="warning",
                ts=job["first_seen"],
                evidence=job,
            )
            groups.setdefault(f"job:{job['job']}", _Group("job", job["job"])).signals.append(sig)
    return [_report(key, g) for key, g in sorted(groups.items())]


def _report(key: str, g: _Group) -> Report:
    sigs = g.signals
    best = max(sigs, key=lambda s: (s.strong, s.score, SEVERITY_RANK.get(s.severity, 0)))
    sources = sorted({s.source for s in sigs})
    strong = any(s.strong for s in sigs) or len(sources) >= 2
    score = round(combined_score(sigs), 3)
    suspects = [SuspectOut(g.suspect_type, g.suspect, score)]
    seen = {(g.suspect_type, g.suspect)}
    for s in sorted(sigs, key=lambda s: -s.score):
        for o in s.others:
            if (o.type, o.id) not in seen:
                seen.add((o.type, o.id))
                suspects.append(o)
    by_source: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in sorted(sigs, key=lambda s: s.ts):
        entry = {"kind": s.kind, "score": round(s.score, 3), "strong": s.strong, **s.evidence}
        if s.member is not None:
            entry["incident"] = s.member
        by_source[s.source].append(entry)
    evidence: dict[str, Any] = {
        "strength": "strong" if strong else "weak",
        "confidence": score,
        "sources": dict(by_source),
        "members": sorted({s.member for s in sigs if s.member is not None}),
    }
    if g.corroboration:
        evidence["corroboration"] = {"nccl": g.corroboration}
    severity = max((s.severity for s in sigs), key=lambda v: SEVERITY_RANK.get(v, 0))
    parts = ", ".join(f"{src} ({len(by_source[src])})" for src in sources)
    return Report(
        key=key,
        kind=best.kind,
        suspects=suspects,
        evidence=evidence,
        first_seen=min(s.ts for s in sigs),
        summary=f"{best.kind} on {g.suspect_type} {g.suspect}: {parts}",
        severity=severity,
    )


def incident_signal(row: Any) -> Signal | None:
    """A detector's open incident as a signal about its top suspect."""
    suspects = row.suspects if not isinstance(row.suspects, str) else json.loads(row.suspects)
    if not suspects:
        return None
    top = suspects[0]
    score = float(top.get("score", 0.0))
    return Signal(
        source=_SOURCE_OF_DETECTOR.get(row.detector, row.detector),
        suspect_type=top["type"],
        suspect=top["id"],
        kind=row.kind,
        score=score,
        strong=row.severity == "critical" and score >= STRONG_SCORE,
        severity=row.severity,
        ts=row.first_seen,
        evidence={"summary": row.summary, "first_seen": row.first_seen.isoformat()},
        member=row.id,
        others=tuple(
            SuspectOut(s["type"], s["id"], float(s.get("score", 0))) for s in suspects[1:]
        ),
    )


def event_signals(rows: Iterable[Any]) -> list[Signal]:
    """Xid and lost-GPU events, one signal per node and kind (samples kept)."""
    per: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for r in rows:
        per[(r.node, r.kind)].append(r)
    out = []
    for (node, kind), evs in per.items():
        if kind == "xid":
            worst = max(evs, key=lambda e: SEVERITY_RANK.get(e.severity, 0))
            spec = _XID_SIGNAL.get(worst.severity)
            if spec is None:
                continue
            attrs = _attrs(worst)
            xids = sorted({_attrs(e).get("xid") for e in evs if _attrs(e).get("xid") is not None})
            evidence = {"xids": xids, "count": len(evs), "pci": attrs.get("pci"),
                        "action": attrs.get("action"),
                        "messages": [e.message for e in evs[:MAX_SAMPLES]]}
        else:  # gpu_lost
            spec = _GPU_LOST_SIGNAL
            worst = evs[0]
            evidence = {"count": len(evs), "messages": [e.message for e in evs[:MAX_SAMPLES]]}
        kind_out, score, strong = spec
        out.append(Signal("gpu", "node", node, kind_out, score, strong,
                          worst.severity if kind == "xid" else "critical",
                          min(e.ts for e in evs), evidence))
    return out


def nccl_findings(rows: Iterable[Any]) -> tuple[list[Signal], list[dict[str, Any]]]:
    """NCCL timeouts/errors per job: node signals where the rank layout places
    the missing or lagging ranks, job-level findings where it cannot."""
    jobs: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        jobs[r.job or f"node:{r.node}"].append(r)
    signals: list[Signal] = []
    unlocalized: list[dict[str, Any]] = []
    for job, evs in jobs.items():
        rank_node = {e.rank: e.node for e in evs if e.rank is not None}
        seqs = {e.rank: _attrs(e).get("seq") for e in evs if e.rank is not None}
        kind = "nccl-timeout" if any(e.kind == "nccl_timeout" for e in evs) else "nccl-error"
        sample = evs[0]
        finding: dict[str, Any] = {
            "job": job,
            "kind": kind,
            "ranks_reporting": len(rank_node),
            "reporting_nodes": sorted({e.node for e in evs}),
            "op": _attrs(sample).get("op"),
            "timeout_ms": _attrs(sample).get("timeout_ms"),
            "messages": [e.message for e in evs[:MAX_SAMPLES]],
            "first_seen": min(e.ts for e in evs),
        }
        suspects = _nccl_suspects(rank_node, seqs)
        finding["missing_ranks"] = sorted(r for r, _ in suspects.get("missing", []))
        finding["lagging_ranks"] = sorted(r for r, _ in suspects.get("lagging", []))
        placed: dict[str, list[str]] = defaultdict(list)
        for why, items in suspects.items():
            for rank, node in items:
                if node is not None:
                    placed[node].append(f"{why} rank {rank}")
        if not placed:
            unlocalized.append(finding)
            continue
        for node, why in placed.items():
            evidence = {k: v for k, v in finding.items() if k != "first_seen"}
            evidence["why"] = why
            signals.append(Signal("nccl", "node", node, kind, NCCL_NODE_SCORE, False, "warning",
                                  finding["first_seen"], evidence))
    return signals, unlocalized


def _nccl_suspects(
    rank_node: dict[int, str], seqs: dict[int, Any]
) -> dict[str, list[tuple[int, str | None]]]:
    out: dict[str, list[tuple[int, str | None]]] = {}
    if not rank_node:
        return out
    # Ranks per node: the commonest count among reporting nodes (the full ones).
    per_node = Counter(rank_node.values())
    block = max(Counter(per_node.values()).items(), key=lambda kv: (kv[1], kv[0]))[0]
    top = max(rank_node)
    world = ((top // block) + 1) * block if block > 0 else top + 1
    missing = [r for r in range(world) if r not in rank_node]
    placed_missing = []
    for r in missing:
        owners = {rank_node[q] for q in range(r - r % block, r - r % block + block)
                  if q in rank_node}
        placed_missing.append((r, owners.pop() if len(owners) == 1 else None))
    if placed_missing:
        out["missing"] = placed_missing
    numeric = {r: s for r, s in seqs.items() if isinstance(s, int)}
    if numeric:
        newest = max(numeric.values())
        lagging = [(r, rank_node[r]) for r, s in numeric.items() if s < newest]
        if lagging and len(lagging) < len(numeric) / 2:
            out["lagging"] = lagging
    return out


def _attrs(row: Any) -> dict[str, Any]:
    a = row.attrs
    return json.loads(a) if isinstance(a, str) else (a or {})


class Correlator:
    """The engine's last detector: merges every source's signals per root-cause suspect."""

    name = DETECTOR_NAME

    def __init__(self, window_s: float = 120.0) -> None:
        self.window_s = window_s

    async def evaluate(self, conn: AsyncConnection, now: datetime) -> list[Report]:
        since = now - timedelta(seconds=self.window_s)
        signals: list[Signal] = []
        for row in await conn.execute(
            text(
                "SELECT id, detector, kind, severity, summary, suspects, first_seen"
                " FROM incidents WHERE state = 'open' AND detector <> :me"
                " AND last_seen >= :since ORDER BY id"
            ),
            {"me": self.name, "since": since},
        ):
            sig = incident_signal(row)
            if sig is not None:
                signals.append(sig)
        events = (
            await conn.execute(
                text(
                    "SELECT node, kind, severity, job, rank, message, attrs, ts FROM events"
                    " WHERE ts >= :since AND ts <= :until"
                    " AND kind IN ('xid', 'gpu_lost', 'nccl_timeout', 'nccl_error')"
                    " ORDER BY ts"
                ),
                {"since": since, "until": now + timedelta(seconds=5)},
            )
        ).all()
        signals += event_signals(e for e in events if e.kind in ("xid", "gpu_lost"))
        nccl_signals, unlocalized = nccl_findings(
            e for e in events if e.kind in ("nccl_timeout", "nccl_error")
        )
        reports = correlate(signals + nccl_signals, unlocalized, now)
        await self._keep_actions(conn, reports)
        return reports

    async def _keep_actions(self, conn: AsyncConnection, reports: list[Report]) -> None:
        # What was done about an incident (isolation by the database, Slurm,
        # Kubernetes: state, attempts, last error) is part of its evidence. The
        # store rewrites evidence each cycle, so rebuild it from the actuation rows.
        rows = await conn.execute(
            text(
                "SELECT i.key, a.id, a.actuator, a.op, a.state, a.attempts, a.last_error,"
                " a.dry_run, a.updated_at FROM incidents i JOIN actuations a"
                " ON a.incident_id = i.id WHERE i.state = 'open' AND i.detector = :me"
                " ORDER BY a.id"
            ),
            {"me": self.name},
        )
        kept: dict[str, dict[str, Any]] = defaultdict(dict)
        for r in rows:
            kept[r.key][f"{r.actuator}:{r.op}:{r.id}"] = action_entry(r)
        for rep in reports:
            actions = kept.get(f"{self.name}:{rep.key}")
            if actions:
                rep.evidence["actions"] = actions


def action_entry(row: Any) -> dict[str, Any]:
    """How one actuation shows in an incident's ``evidence.actions``."""
    return {
        "actuator": row.actuator,
        "op": row.op,
        "state": row.state,
        "attempts": row.attempts,
        "last_error": row.last_error,
        "dry_run": row.dry_run,
        "updated_at": row.updated_at.isoformat() if row.updated_at else None,
    }
