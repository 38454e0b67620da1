"""Alert webhooks: an outbox written with the incident change, and a delivery worker.

``enqueue`` runs inside the transaction that changes the incident (an
``IncidentStore`` hook) or isolates a node, and writes one ``webhook_outbox``
row per matching subscription: the alert exists exactly when the change does.
``WebhookDispatcher`` runs on every replica; each delivery slot claims one due
row with ``SELECT ... FOR UPDATE SKIP LOCKED`` and keeps it locked while it
posts, so two replicas never send the same row at once, and a replica that
dies mid-delivery releases the row to be sent again with the same delivery
id. Receivers deduplicate on that id (``X-Meshwatch-Delivery`` and
``Idempotency-Key``). Failures back off exponentially; after
``max_attempts`` the row is ``dead`` and stays visible in the API.

Formats:

- ``native``: the event as JSON, signed: ``X-Meshwatch-Timestamp`` (Unix
  seconds) and ``X-Meshwatch-Signature: sha256=<hex>``, the HMAC-SHA256 with
  the subscription's secret of ``"{timestamp}.{body}"``;
- ``slack``: ``{"text": ...}`` for Slack-compatible incoming webhooks;
- ``alertmanager``: ``POST {url}/api/v2/alerts`` with one alert per incident
  (labels, annotations, ``startsAt``; ``endsAt`` once closed), re-sent every
  ``alertmanager_refresh_s`` while open so Alertmanager does not resolve it.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.settings import Settings

log = logging.getLogger(__name__)

SEVERITIES = ("info", "warning", "error", "critical")
FORMATS = ("native", "slack", "alertmanager")
SIGNATURE_HEADER = "X-Meshwatch-Signature"
TIMESTAMP_HEADER = "X-Meshwatch-Timestamp"
DELIVERY_HEADER = "X-Meshwatch-Delivery"
EVENT_HEADER = "X-Meshwatch-Event"
MAX_ERROR = 2000


def sign(secret: str, timestamp: str, body: bytes) -> str:
    """The ``X-Meshwatch-Signature`` value for a body sent at ``timestamp``."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify(secret: str, timestamp: str, body: bytes, signature: str) -> bool:
    """What a receiver does: recompute and compare in constant time."""
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


def _incident_view(incident: dict[str, Any]) -> dict[str, Any]:
    keep = ("id", "key", "detector", "kind", "state", "severity", "summary", "primary_node",
            "suspects", "evidence", "first_seen", "opened_at", "updated_at", "closed_at")
    return {k: incident.get(k) for k in keep}


def matches(sub: Any, kind: str, severity: str) -> bool:
    if sub.kinds and kind not in sub.kinds:
        return False
    rank = SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)
    return rank >= SEVERITIES.index(sub.min_severity)


async def enqueue(
    conn: AsyncConnection,
    event: str,
    *,
    kind: str,
    severity: str,
    incident: dict[str, Any] | None = None,
    action: dict[str, Any] | None = None,
    node: str | None = None,
    only_formats: tuple[str, ...] = FORMATS,
    refresh_s: float | None = None,
) -> int:
    """Write one outbox row per enabled subscription that wants this event.

    ``refresh_s``: skip subscriptions that got a row for this incident more
    recently than that (the periodic Alertmanager re-send).
    """
    subs = await conn.execute(
        text("SELECT id, format, kinds, min_severity FROM webhooks WHERE enabled ORDER BY id")
    )
    payload = {
        "event": event,
        "kind": kind,
        "severity": severity,
        "node": node or (incident or {}).get("primary_node"),
        "incident": _incident_view(incident) if incident else None,
        "action": action,
        "created_at": datetime.now(UTC).isoformat(),
    }
    body = json.dumps(payload, default=_json_default)
    written = 0
    for sub in subs.all():
        if sub.format not in only_formats or not matches(sub, kind, severity):
            continue
        if sub.format == "alertmanager" and incident is None:
            continue  # Alertmanager alerts are incidents; node events have no end
        if refresh_s is not None and incident is not None:
            recent = (
                await conn.execute(
                    text(
                        "SELECT 1 FROM webhook_outbox WHERE webhook_id = :w AND incident_id = :i"
                        " AND created_at > now() - make_interval(secs => :s) LIMIT 1"
                    ),
                    {"w": sub.id, "i": incident.get("id"), "s": refresh_s},
                )
            ).first()
            if recent:
                continue
        await conn.execute(
            text(
                "INSERT INTO webhook_outbox (webhook_id, incident_id, event, payload)"
                " VALUES (:w, :i, :e, CAST(:p AS jsonb))"
            ),
            {"w": sub.id, "i": (incident or {}).get("id"), "e": event, "p": body},
        )
        written += 1
    return written


def _json_default(o: Any) -> str:
    # RFC 3339 timestamps (Alertmanager refuses str(datetime)'s space).
    return o.isoformat() if isinstance(o, datetime) else str(o)


def _iso(v: Any) -> str | None:
    if v is None:
        return None
    return v if isinstance(v, str) else v.isoformat()


def alertmanager_alert(payload: dict[str, Any], generator_url: str = "") -> dict[str, Any]:
    """One Alertmanager v2 alert for the incident in ``payload``."""
    inc = payload["incident"]
    labels = {
        "alertname": "Meshwatch" + "".join(p.capitalize() for p in inc["kind"].split("-")),
        "source": "meshwatch",
        "kind": inc["kind"],
        "severity": inc["severity"],
        "incident": str(inc["id"]),
    }
    suspects = inc.get("suspects") or []
    if suspects:
        labels[suspects[0]["type"]] = suspects[0]["id"]
    annotations = {"summary": inc.get("summary") or inc["kind"]}
    if payload.get("action"):
        annotations["action"] = (
            f"{payload['action']['decision']}: {payload['action']['reason']}"
        )
    alert: dict[str, Any] = {
        "labels": labels,
        "annotations": annotations,
        "startsAt": _iso(inc.get("opened_at")),
    }
    if inc.get("state") == "closed" and inc.get("closed_at"):
        alert["endsAt"] = _iso(inc["closed_at"])
    if generator_url:
        alert["generatorURL"] = generator_url
    return alert


def slack_message(payload: dict[str, Any]) -> dict[str, Any]:
    inc = payload.get("incident")
    action = payload.get("action")
    if inc:
        what = inc.get("summary") or inc["kind"]
        head = f"[{inc['severity'].upper()}] {payload['event']}: {what}"
    else:
        head = f"{payload['event']}: node {payload.get('node')}"
    lines = [head]
    if action:
        lines.append(f"action: {action['decision']} ({action['reason']})")
    return {"text": "\n".join(lines)}


def render(
    fmt: str, url: str, secret: str, delivery_id: int, payload: dict[str, Any],
    now: float | None = None,
) -> tuple[str, bytes, dict[str, str]]:
    """The URL, body and headers of one delivery attempt."""
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "meshwatch-webhook/1",
        DELIVERY_HEADER: str(delivery_id),
        "Idempotency-Key": str(delivery_id),
        EVENT_HEADER: payload["event"],
    }
    if fmt == "alertmanager":
        target = url.rstrip("/") + "/api/v2/alerts"
        body = json.dumps([alertmanager_alert(payload)]).encode()
    elif fmt == "slack":
        target = url
        body = json.dumps(slack_message(payload)).encode()
    else:
        target = url
        body = json.dumps({"delivery": delivery_id, **payload}, default=str).encode()
        ts = str(int(now if now is not None else time.time()))
        headers[TIMESTAMP_HEADER] = ts
        headers[SIGNATURE_HEADER] = sign(secret, ts, body)
    return target, body, headers


class WebhookDispatcher:
    """Delivers due outbox rows: several slots, each one row at a time."""

    def __init__(
        self,
        engine: AsyncEngine,
        max_attempts: int = 8,
        backoff_s: float = 2.0,
        backoff_max_s: float = 600.0,
        timeout_s: float = 10.0,
        concurrency: int = 4,
        interval_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.timeout_s = timeout_s
        self.concurrency = concurrency
        self.interval_s = interval_s

    @classmethod
    def from_settings(cls, engine: AsyncEngine, s: Settings) -> WebhookDispatcher:
        return cls(
            engine,
            s.webhook_max_attempts,
            s.webhook_backoff_s,
            s.webhook_backoff_max_s,
            s.webhook_timeout_s,
            s.webhook_concurrency,
            s.webhook_interval_s,
        )

    def backoff(self, attempts: int) -> float:
        return min(self.backoff_max_s, self.backoff_s * 2 ** (attempts - 1))

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:
            while True:
                try:
                    await self.drain(client)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("webhook delivery round failed; retrying")
                await asyncio.sleep(self.interval_s)

    async def drain(self, client: httpx.AsyncClient) -> int:
        """Deliver until nothing is due; returns how many attempts were made."""

        async def slot() -> int:
            n = 0
            while await self.deliver_one(client):
                n += 1
            return n

        return sum(await asyncio.gather(*(slot() for _ in range(self.concurrency))))

    async def deliver_one(self, client: httpx.AsyncClient) -> bool:
        async with self.engine.begin() as conn:
            row = (
                await conn.execute(
                    text(
                        "SELECT o.id, o.payload, o.attempts, w.url, w.secret, w.format"
                        " FROM webhook_outbox o JOIN webhooks w ON w.id = o.webhook_id"
                        " WHERE o.state = 'pending' AND o.next_attempt_at <= now()"
                        " ORDER BY o.id LIMIT 1 FOR UPDATE OF o SKIP LOCKED"
                    )
                )
            ).first()
            if row is None:
                return False
            payload = row.payload if isinstance(row.payload, dict) else json.loads(row.payload)
            target, body, headers = render(row.format, row.url, row.secret, row.id, payload)
            status: int | None = None
            error: str | None = None
            try:
                resp = await client.post(target, content=body, headers=headers)
                status = resp.status_code
                if not 200 <= status < 300:
                    error = f"HTTP {status}: {resp.text[:500]}"
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
            attempts = row.attempts + 1
            if error is None:
                state, delay = "delivered", 0.0
            elif attempts >= self.max_attempts:
                state, delay = "dead", 0.0
                log.warning("webhook delivery %d dead after %d attempts: %s", row.id, attempts,
                            error)
            else:
                state, delay = "pending", self.backoff(attempts)
            await conn.execute(
                text(
                    "UPDATE webhook_outbox SET state = :state, attempts = :attempts,"
                    " last_status = :status, last_error = :error,"
                    " next_attempt_at = clock_timestamp() + make_interval(secs => :delay),"
                    " delivered_at = CASE WHEN :done THEN clock_timestamp() END"
                    " WHERE id = :id"
                ),
                {"state": state, "done": state == "delivered", "attempts": attempts,
                 "status": status,
                 "error": error[:MAX_ERROR] if error else None, "delay": delay, "id": row.id},
            )
        return True
