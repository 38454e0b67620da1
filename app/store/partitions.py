"""Daily partitions of the telemetry tables, and retention by dropping them.

Partitions exist for every day of the retention window and two days ahead;
``maintain`` runs at start and every hour. Ingest refuses samples outside
that window (see ``app.api.ingest``), so COPY never meets a missing partition.
"""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.store.models import PARTITIONED_TABLES

DAYS_AHEAD = 2
_SUFFIX = re.compile(r"_p(\d{8})$")


def _name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


async def maintain(conn: AsyncConnection, retention_days: int, today: date | None = None) -> dict:
    """Create missing partitions and drop those wholly older than retention."""
    today = today or datetime.now(UTC).date()
    first = today - timedelta(days=retention_days)
    created, dropped = [], []
    existing = {
        r[0]
        for r in await conn.execute(
            text(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "JOIN pg_class p ON p.oid = i.inhparent WHERE p.relname = ANY(:t)"
            ),
            {"t": list(PARTITIONED_TABLES)},
        )
    }
    for table in PARTITIONED_TABLES:
        day = first
        while day <= today + timedelta(days=DAYS_AHEAD):
            name = _name(table, day)
            if name not in existing:
                await conn.execute(
                    text(
                        f"CREATE TABLE IF NOT EXISTS {name} PARTITION OF {table} "
                        f"FOR VALUES FROM ('{day.isoformat()}') "
                        f"TO ('{(day + timedelta(days=1)).isoformat()}')"
                    )
                )
                created.append(name)
            day += timedelta(days=1)
    for name in sorted(existing):
        m = _SUFFIX.search(name)
        if m and datetime.strptime(m.group(1), "%Y%m%d").date() < first:
            await conn.execute(text(f"DROP TABLE IF EXISTS {name}"))
            dropped.append(name)
    # Plain tables with per-row history follow the same retention.
    cutoff = datetime.now(UTC) - timedelta(days=retention_days)
    for table in ("ingest_batches", "job_steps"):
        await conn.execute(text(f"DELETE FROM {table} WHERE received_at < :t"), {"t": cutoff})
    return {"created": created, "dropped": dropped}


def window(retention_days: int, now: datetime | None = None) -> tuple[datetime, datetime]:
    """The [oldest, newest) instants that have a partition."""
    now = now or datetime.now(UTC)
    first = datetime.combine(now.date() - timedelta(days=retention_days), datetime.min.time(), UTC)
    end = datetime.combine(now.date() + timedelta(days=DAYS_AHEAD + 1), datetime.min.time(), UTC)
    return first, end
