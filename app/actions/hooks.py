"""Wiring of the actions into the backend: the ``IncidentStore`` hook that runs
the isolation policy and writes the webhook outbox in the incident's own
transaction, and the background loops that deliver webhooks and carry out
external actuations.

Only correlated incidents (detector ``correlator``) are acted on and alerted:
the detectors' own incidents are the correlator's inputs, and acting on them
as well would alert and decide twice for one fault.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from sqlalchemy.ext.asyncio import AsyncConnection

from app.actions import webhooks
from app.actions.actuators import ActuatorWorker
from app.actions.policy import Decision, IsolationPolicy
from app.analysis.correlate import DETECTOR_NAME, Correlator
from app.analysis.incidents import Change
from app.settings import Settings

log = logging.getLogger(__name__)


class IncidentActions:
    """The ``IncidentStore`` hook: policy decision first, then the outbox rows,
    so an alert carries what was decided about its incident."""

    def __init__(self, policy: IsolationPolicy, alertmanager_refresh_s: float = 60.0) -> None:
        self.policy = policy
        self.alertmanager_refresh_s = alertmanager_refresh_s

    @classmethod
    def from_settings(cls, s: Settings) -> IncidentActions:
        return cls(IsolationPolicy.from_settings(s), s.alertmanager_refresh_s)

    async def __call__(self, conn: AsyncConnection, change: Change) -> None:
        inc = change.incident
        if inc.get("detector") != DETECTOR_NAME:
            return
        decision: Decision | None = None
        if change.action != "closed":
            decision = await self._decide(conn, inc)
        common: dict[str, Any] = {
            "kind": inc["kind"],
            "severity": inc["severity"],
            "incident": inc,
            "action": decision.as_dict() if decision else None,
        }
        if change.action == "opened":
            await webhooks.enqueue(conn, "incident.opened", **common)
        elif change.action == "closed":
            await webhooks.enqueue(conn, "incident.closed", **common)
        elif decision is not None and decision.notable:
            await webhooks.enqueue(conn, "incident.action", **common)
        else:
            await webhooks.enqueue(
                conn, "incident.updated", only_formats=("alertmanager",),
                refresh_s=self.alertmanager_refresh_s, **common,
            )

    async def _decide(self, conn: AsyncConnection, inc: dict[str, Any]) -> Decision | None:
        # A policy failure must not lose the incident or its alert: it is
        # rolled back to a savepoint, logged, and retried on the next update.
        try:
            async with conn.begin_nested():
                return await self.policy.evaluate(conn, inc)
        except Exception:
            log.exception("isolation policy failed for incident %s", inc.get("id"))
            return None


def install(app: FastAPI, analysis_engine: Any) -> None:
    """Add the correlator (last, so it sees this cycle's findings) and the
    actions hook to an ``AnalysisEngine``."""
    settings: Settings = app.state.settings
    analysis_engine.detectors.append(Correlator(window_s=settings.correlate_window_s))
    analysis_engine.store.hooks.append(IncidentActions.from_settings(settings))


async def run_webhook_worker(app: FastAPI) -> None:
    await webhooks.WebhookDispatcher.from_settings(app.state.engine, app.state.settings).run()


async def run_actuator_worker(app: FastAPI) -> None:
    await ActuatorWorker.from_settings(app.state.engine, app.state.settings).run()
