"""The analysis engine: once a second (and at once when ingest signals
trouble), every detector reads recent rows and reports the faults it sees;
``IncidentStore`` turns the reports into incident rows.

Only one engine acts at a time, however many backend replicas run: the
leader holds a PostgreSQL advisory lock on a dedicated connection, and the
others wait to take over if that connection dies. Ingest wakes the leader
through NOTIFY when a batch carries loss or events, which is what makes
detection take about a second rather than a polling period plus a second.
A failing detector is logged and skipped; it never stops the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Protocol

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.analysis.incidents import Change, IncidentStore, Report
from app.analysis.leadership import Leadership

log = logging.getLogger(__name__)

ENGINE_LOCK = 0x6D770001
WAKE_CHANNEL = "meshwatch_wake"
# After a wake-up, wait this long for the other agents' batches of the same
# second, so one evaluation sees them all.
WAKE_SETTLE_S = 0.15
WAKE_FOLLOW_UP_S = 1.1


class Detector(Protocol):
    name: str

    async def evaluate(self, conn: AsyncConnection, now: datetime) -> list[Report]: ...


class AnalysisEngine:
    def __init__(
        self,
        engine: AsyncEngine,
        detectors: Sequence[Detector],
        store: IncidentStore | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.detectors = list(detectors)
        self.store = store or IncidentStore()
        self.interval_s = interval_s
        self._leadership: Leadership | None = None
        self.cycles = 0
        self._wake = asyncio.Event()

    async def cycle(self, now: datetime | None = None) -> list[Change]:
        """Run every detector once; each in its own transaction."""
        now = now or datetime.now(UTC)
        changes: list[Change] = []
        for det in self.detectors:
            try:
                async with self.engine.begin() as conn:
                    reports = await det.evaluate(conn, now)
                    changes += await self.store.sync(conn, det.name, reports, now)
            except Exception:
                log.exception("detector %s failed; skipped this cycle", det.name)
        self.cycles += 1
        for c in changes:
            if c.action != "updated":
                log.warning("incident %s %s: %s", c.incident["id"], c.action, c.incident["summary"])
        return changes

    def _on_notify(self, *_args: object) -> None:
        self._wake.set()

    async def run(self) -> None:
        """Forever: become leader when possible, then cycle."""
        self._leadership = Leadership(
            self.engine, ENGINE_LOCK, WAKE_CHANNEL, self._on_notify, "analysis engine"
        )
        await self._leadership.run(self._lead)

    @property
    def is_leader(self) -> bool:
        return self._leadership is not None and self._leadership.is_leader

    async def _lead(self, raw: object) -> None:
        next_at = time.monotonic()
        while True:
            if getattr(raw, "is_closed")():  # noqa: B009 - asyncpg connection
                raise ConnectionError("leader connection closed")
            timeout = max(0.0, next_at - time.monotonic())
            woken = False
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
                await asyncio.sleep(WAKE_SETTLE_S)
                woken = True
            except TimeoutError:
                pass
            self._wake.clear()
            await self.cycle()
            # After a wake-up, look again soon whatever the interval: detectors that
            # wait for a fault's reports to settle (hangs) decide on that second look.
            delay = min(self.interval_s, WAKE_FOLLOW_UP_S) if woken else self.interval_s
            next_at = time.monotonic() + delay


async def notify_wake(conn: AsyncConnection, node: str) -> None:
    """Called by ingest inside its transaction; delivered at commit."""
    await conn.execute(text("SELECT pg_notify(:c, :n)"), {"c": WAKE_CHANNEL, "n": node})
