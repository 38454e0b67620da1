"""Incidents as rows: open, update and close them from detector findings.

Each detector reports, every cycle, the faults it currently sees, each with
a stable ``key``. ``IncidentStore.sync`` turns that list into row changes:
a new key opens an incident, a known key refreshes its evidence, and a key
missing for ``close_after_s`` closes it. Other stages (isolation, webhooks)
hook into the same transaction through ``on_change`` so that nothing is
lost between "the incident changed" and "someone was told".
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection


@dataclass(frozen=True)
class SuspectOut:
    type: str
    id: str
    score: float


@dataclass
class Report:
    """A detector's finding in the engine's common shape."""

    key: str
    kind: str
    suspects: list[SuspectOut]
    evidence: dict[str, Any]
    first_seen: datetime
    summary: str = ""
    severity: str = "error"

    @property
    def primary_node(self) -> str | None:
        for s in self.suspects[:1]:
            if s.type == "node":
                return s.id
        return None


@dataclass
class Change:
    action: str  # opened | updated | closed
    incident: dict[str, Any]


ChangeHook = Callable[[AsyncConnection, Change], Awaitable[None]]

INCIDENT_COLUMNS = (
    "id, key, detector, kind, state, severity, summary, primary_node, suspects, evidence,"
    " first_seen, opened_at, updated_at, last_seen, closed_at"
)


def row_to_dict(row: Any) -> dict[str, Any]:
    d = dict(row._mapping)
    for k in ("suspects", "evidence"):
        if isinstance(d.get(k), str):
            d[k] = json.loads(d[k])
    return d


@dataclass
class IncidentStore:
    close_after_s: float = 5.0
    hooks: list[ChangeHook] = field(default_factory=list)

    async def sync(
        self, conn: AsyncConnection, detector: str, reports: Sequence[Report], now: datetime
    ) -> list[Change]:
        """Apply one cycle of a detector's reports; returns what changed."""
        changes: list[Change] = []
        open_rows = {
            r.key: r
            for r in await conn.execute(
                text(
                    f"SELECT {INCIDENT_COLUMNS} FROM incidents"
                    " WHERE state = 'open' AND detector = :d"
                ),
                {"d": detector},
            )
        }
        for rep in reports:
            key = f"{detector}:{rep.key}"
            params = {
                "key": key,
                "detector": detector,
                "kind": rep.kind,
                "severity": rep.severity,
                "summary": rep.summary,
                "primary_node": rep.primary_node,
                "suspects": json.dumps([s.__dict__ for s in rep.suspects]),
                "evidence": json.dumps(rep.evidence, default=str),
                "first_seen": rep.first_seen,
                "now": now,
            }
            if key in open_rows:
                row = (
                    await conn.execute(
                        text(
                            "UPDATE incidents SET suspects = CAST(:suspects AS jsonb),"
                            " evidence = CAST(:evidence AS jsonb), summary = :summary,"
                            " severity = :severity, primary_node = :primary_node,"
                            f" updated_at = :now, last_seen = :now WHERE key = :key"
                            f" AND state = 'open' RETURNING {INCIDENT_COLUMNS}"
                        ),
                        params,
                    )
                ).one()
                changes.append(Change("updated", row_to_dict(row)))
            else:
                row = (
                    await conn.execute(
                        text(
                            "INSERT INTO incidents (key, detector, kind, severity, summary,"
                            " primary_node, suspects, evidence, first_seen, opened_at,"
                            " updated_at, last_seen) VALUES (:key, :detector, :kind, :severity,"
                            " :summary, :primary_node, CAST(:suspects AS jsonb),"
                            " CAST(:evidence AS jsonb), :first_seen, :now, :now, :now)"
                            f" RETURNING {INCIDENT_COLUMNS}"
                        ),
                        params,
                    )
                ).one()
                changes.append(Change("opened", row_to_dict(row)))
        seen = {f"{detector}:{r.key}" for r in reports}
        for key, row in open_rows.items():
            if key in seen:
                continue
            if (now - row.last_seen).total_seconds() >= self.close_after_s:
                closed = (
                    await conn.execute(
                        text(
                            "UPDATE incidents SET state = 'closed', closed_at = :now,"
                            f" updated_at = :now WHERE id = :id RETURNING {INCIDENT_COLUMNS}"
                        ),
                        {"id": row.id, "now": now},
                    )
                ).one()
                changes.append(Change("closed", row_to_dict(closed)))
        for change in changes:
            for hook in self.hooks:
                await hook(conn, change)
        return changes
