"""Alert webhook subscriptions and their deliveries (admin only).

A subscription has a URL, a secret (for the native format's HMAC signature),
a format (``native``, ``slack``, ``alertmanager``) and filters: incident kinds
(empty: all) and a minimum severity. ``GET .../deliveries`` shows the outbox:
pending rows with their next attempt, delivered ones, and dead letters with
the last error; a dead delivery can be queued again.
"""

from __future__ import annotations

import json
import secrets
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response, status
from pydantic import AnyHttpUrl, BaseModel, Field
from sqlalchemy import text

from app.api.deps import Principal, SessionDep, require

router = APIRouter(prefix="/api/v1/webhooks", tags=["webhooks"])

Severity = Literal["info", "warning", "error", "critical"]
Format = Literal["native", "slack", "alertmanager"]
_COLUMNS = "id, name, url, format, kinds, min_severity, enabled, created_at"


class WebhookCreate(BaseModel):
    name: str = Field(min_length=1, max_length=200)
    url: AnyHttpUrl
    secret: str | None = Field(
        None, min_length=16, max_length=512, description="generated when omitted"
    )
    format: Format = "native"
    kinds: list[str] | None = Field(None, description="incident kinds; empty or null: all")
    min_severity: Severity = "info"
    enabled: bool = True


class WebhookOut(BaseModel):
    id: int
    name: str
    url: str
    format: str
    kinds: list[str] | None
    min_severity: str
    enabled: bool
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="shown only in this response")


class DeliveryOut(BaseModel):
    id: int
    webhook_id: int
    incident_id: int | None
    event: str
    state: str
    attempts: int
    next_attempt_at: datetime
    last_status: int | None
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    payload: dict[str, Any]


async def _get(session: Any, webhook_id: int) -> dict[str, Any]:
    row = (
        await session.execute(
            text(f"SELECT {_COLUMNS} FROM webhooks WHERE id = :id"), {"id": webhook_id}
        )
    ).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no webhook {webhook_id}")
    return dict(row._mapping)


@router.post("", response_model=WebhookCreated, status_code=status.HTTP_201_CREATED)
async def create_webhook(
    body: WebhookCreate, session: SessionDep, principal: Principal = require("admin")
) -> dict[str, Any]:
    """Subscribe a URL to incident and isolation alerts; the secret is shown once."""
    secret = body.secret or secrets.token_urlsafe(32)
    row = (
        await session.execute(
            text(
                "INSERT INTO webhooks (name, url, secret, format, kinds, min_severity, enabled)"
                " VALUES (:name, :url, :secret, :format, :kinds, :min_severity, :enabled)"
                f" RETURNING {_COLUMNS}"
            ),
            {
                "name": body.name,
                "url": str(body.url),
                "secret": secret,
                "format": body.format,
                "kinds": body.kinds or None,
                "min_severity": body.min_severity,
                "enabled": body.enabled,
            },
        )
    ).one()
    await session.commit()
    return {**dict(row._mapping), "secret": secret}


@router.get("", response_model=list[WebhookOut])
async def list_webhooks(
    session: SessionDep, principal: Principal = require("admin")
) -> list[dict[str, Any]]:
    """List subscriptions (never their secrets)."""
    rows = await session.execute(text(f"SELECT {_COLUMNS} FROM webhooks ORDER BY id"))
    return [dict(r._mapping) for r in rows]


@router.get("/{webhook_id}", response_model=WebhookOut)
async def get_webhook(
    webhook_id: int, session: SessionDep, principal: Principal = require("admin")
) -> dict[str, Any]:
    """One subscription."""
    return await _get(session, webhook_id)


@router.delete("/{webhook_id}", status_code=status.HTTP_204_NO_CONTENT)
async def delete_webhook(
    webhook_id: int, session: SessionDep, principal: Principal = require("admin")
) -> Response:
    """Remove a subscription and its undelivered outbox rows."""
    result = await session.execute(text("DELETE FROM webhooks WHERE id = :id"), {"id": webhook_id})
    if result.rowcount == 0:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no webhook {webhook_id}")
    await session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/{webhook_id}/deliveries", response_model=list[DeliveryOut])
async def list_deliveries(
    webhook_id: int,
    session: SessionDep,
    principal: Principal = require("admin"),
    state: Literal["pending", "delivered", "dead"] | None = None,
    limit: int = Query(100, ge=1, le=1000),
) -> list[dict[str, Any]]:
    """The subscription's outbox, newest first: pending, delivered and dead letters."""
    await _get(session, webhook_id)
    sql = "SELECT * FROM webhook_outbox WHERE webhook_id = :w"
    params: dict[str, Any] = {"w": webhook_id, "limit": limit}
    if state:
        sql += " AND state = :state"
        params["state"] = state
    rows = await session.execute(text(sql + " ORDER BY id DESC LIMIT :limit"), params)
    out = []
    for r in rows:
        d = dict(r._mapping)
        if isinstance(d["payload"], str):
            d["payload"] = json.loads(d["payload"])
        out.append(d)
    return out


@router.post("/{webhook_id}/deliveries/{delivery_id}/retry", response_model=DeliveryOut)
async def retry_delivery(
    webhook_id: int, delivery_id: int, session: SessionDep,
    principal: Principal = require("admin"),
) -> dict[str, Any]:
    """Queue a dead delivery again, with a fresh attempt budget and the same delivery id."""
    row = (
        await session.execute(
            text(
                "UPDATE webhook_outbox SET state = 'pending', attempts = 0,"
                " next_attempt_at = now() WHERE id = :d AND webhook_id = :w AND state = 'dead'"
                " RETURNING *"
            ),
            {"d": delivery_id, "w": webhook_id},
        )
    ).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no dead delivery {delivery_id}")
    await session.commit()
    d = dict(row._mapping)
    if isinstance(d["payload"], str):
        d["payload"] = json.loads(d["payload"])
    return d
