"""Incidents: what meshwatch concluded, with suspects and evidence."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, status
from pydantic import BaseModel
from sqlalchemy import text

from app.analysis.incidents import INCIDENT_COLUMNS, row_to_dict
from app.api.deps import Principal, SessionDep, require

router = APIRouter(prefix="/api/v1/incidents", tags=["incidents"])


class IncidentOut(BaseModel):
    id: int
    key: str
    detector: str
    kind: str
    state: str
    severity: str
    summary: str
    primary_node: str | None
    suspects: list[dict[str, Any]]
    evidence: dict[str, Any]
    first_seen: datetime
    opened_at: datetime
    updated_at: datetime
    last_seen: datetime
    closed_at: datetime | None


@router.get("", response_model=list[IncidentOut])
async def list_incidents(
    session: SessionDep,
    principal: Principal = require("read"),
    state: Literal["open", "closed"] | None = None,
    kind: str | None = None,
    node: str | None = Query(None, description="incidents whose primary suspect is this node"),
    limit: int = Query(100, ge=1, le=1000),
) -> list[dict[str, Any]]:
    """List incidents, newest first; filter by state, kind or node."""
    where, params = [], {"limit": limit}
    if state:
        where.append("state = :state")
        params["state"] = state
    if kind:
        where.append("kind = :kind")
        params["kind"] = kind
    if node:
        where.append("primary_node = :node")
        params["node"] = node
    sql = f"SELECT {INCIDENT_COLUMNS} FROM incidents"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += " ORDER BY opened_at DESC LIMIT :limit"
    return [row_to_dict(r) for r in await session.execute(text(sql), params)]


@router.get("/{incident_id}", response_model=IncidentOut)
async def get_incident(
    incident_id: int, session: SessionDep, principal: Principal = require("read")
) -> dict[str, Any]:
    """One incident with its full evidence."""
    row = (
        await session.execute(
            text(f"SELECT {INCIDENT_COLUMNS} FROM incidents WHERE id = :id"), {"id": incident_id}
        )
    ).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no incident {incident_id}")
    return row_to_dict(row)
