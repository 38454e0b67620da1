"""The scheduler's view of one node, manual isolate and release, and the audit log.

``GET /api/v1/nodes/{id}`` (read): state, why it is isolated, open incidents,
last telemetry, recent decisions and actuations. ``POST .../isolate`` and
``.../release`` (isolate role) with a reason; a manual isolation obeys the
isolated-fraction guardrail unless an admin sets ``force``. Every call is
audited with the caller's token name.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, status
from pydantic import BaseModel, Field
from sqlalchemy import select, text

from app.actions import webhooks
from app.actions.policy import (
    Guardrails,
    apply_isolation,
    apply_release,
    audit,
    external_actuators,
    lock_isolation,
)
from app.analysis.incidents import row_to_dict
from app.api.deps import Principal, SessionDep, SettingsDep, require
from app.api.nodes import NodeOut, node_out
from app.store.models import Node

router = APIRouter(tags=["isolation"])

_INCIDENT_COLUMNS = (
    "id, key, detector, kind, state, severity, summary, primary_node, suspects, evidence,"
    " first_seen, opened_at, updated_at, last_seen, closed_at"
)


class IsolationInfo(BaseModel):
    state: str
    reason: str
    actor: str
    automatic: bool
    incident_id: int | None
    changed_at: datetime


class AuditOut(BaseModel):
    id: int
    ts: datetime
    node: str | None
    action: str
    decision: str
    reason: str
    rule: str | None
    incident_id: int | None
    actor: str
    automatic: bool
    dry_run: bool
    details: dict[str, Any]


class ActuationOut(BaseModel):
    id: int
    node: str
    actuator: str
    op: str
    reason: str
    incident_id: int | None
    dry_run: bool
    state: str
    attempts: int
    next_attempt_at: datetime
    last_error: str | None
    output: str | None
    created_at: datetime
    updated_at: datetime


class NodeDetail(NodeOut):
    last_seq: int | None
    isolation: IsolationInfo | None
    open_incidents: list[dict[str, Any]]
    audit: list[AuditOut]
    actuations: list[ActuationOut]


class IsolateRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=1000)
    dry_run: bool = Field(False, description="evaluate and audit, change nothing")
    force: bool = Field(False, description="admin only: ignore the isolated-fraction limit")


class ReleaseRequest(BaseModel):
    reason: str = Field(min_length=1, max_length=1000)
    dry_run: bool = False


class IsolationResult(BaseModel):
    node: str
    decision: Literal["isolated", "released", "dry-run", "unchanged"]
    state: str
    reason: str
    audit_id: int


class IncidentActionsOut(BaseModel):
    incident_id: int
    audit: list[AuditOut]
    actuations: list[ActuationOut]


def _jsonb(d: dict[str, Any], *keys: str) -> dict[str, Any]:
    for k in keys:
        if isinstance(d.get(k), str):
            d[k] = json.loads(d[k])
    return d


async def _audit_rows(session: Any, where: str, params: dict[str, Any], limit: int) -> list[Any]:
    rows = await session.execute(
        text(f"SELECT * FROM isolation_audit WHERE {where} ORDER BY id DESC LIMIT :limit"),
        {**params, "limit": limit},
    )
    return [_jsonb(dict(r._mapping), "details") for r in rows]


async def _actuation_rows(session: Any, where: str, params: dict[str, Any], limit: int
                          ) -> list[Any]:
    rows = await session.execute(
        text(f"SELECT * FROM actuations WHERE {where} ORDER BY id DESC LIMIT :limit"),
        {**params, "limit": limit},
    )
    return [dict(r._mapping) for r in rows]


async def _node_or_404(session: Any, node_id: str) -> Node:
    node = (await session.execute(select(Node).where(Node.id == node_id))).scalar()
    if node is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no node {node_id!r}")
    return node


@router.get("/api/v1/nodes/{node_id}", response_model=NodeDetail, tags=["nodes"])
async def get_node(
    node_id: str, session: SessionDep, principal: Principal = require("read")
) -> dict[str, Any]:
    """One node: state, isolation, open incidents naming it, last telemetry, decisions."""
    node = await _node_or_404(session, node_id)
    out = node_out(node, datetime.now(UTC)).model_dump()
    iso = (
        await session.execute(
            text("SELECT state, reason, actor, automatic, incident_id, changed_at"
                 " FROM node_isolation WHERE node = :n"),
            {"n": node_id},
        )
    ).first()
    incidents = await session.execute(
        text(
            f"SELECT {_INCIDENT_COLUMNS} FROM incidents WHERE state = 'open' AND"
            " (primary_node = :n OR suspects @> CAST(:probe AS jsonb))"
            " ORDER BY opened_at DESC LIMIT 100"
        ),
        {"n": node_id, "probe": json.dumps([{"type": "node", "id": node_id}])},
    )
    out.update(
        last_seq=node.last_seq,
        isolation=dict(iso._mapping) if iso else None,
        open_incidents=[row_to_dict(r) for r in incidents],
        audit=await _audit_rows(session, "node = :n", {"n": node_id}, 20),
        actuations=await _actuation_rows(session, "node = :n", {"n": node_id}, 20),
    )
    return out


@router.post("/api/v1/nodes/{node_id}/isolate", response_model=IsolationResult, tags=["nodes"],
             responses={409: {"description": "refused by a guardrail"}})
async def isolate_node(
    node_id: str,
    body: IsolateRequest,
    session: SessionDep,
    settings: SettingsDep,
    principal: Principal = require("isolate"),
) -> IsolationResult:
    """Take a node out of scheduling (manual isolation), with a reason."""
    if body.force and not principal.can("admin"):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "only an admin may force an isolation")
    conn = await session.connection()
    await lock_isolation(conn)
    await _node_or_404(session, node_id)
    state = (
        await conn.execute(text("SELECT state FROM nodes WHERE id = :n FOR UPDATE"),
                           {"n": node_id})
    ).scalar_one()
    common = {"node": node_id, "action": "isolate", "actor": principal.name}
    if state == "isolated":
        audit_id = await audit(conn, decision="already-isolated", reason=body.reason, **common)
        await session.commit()
        return IsolationResult(node=node_id, decision="unchanged", state=state,
                               reason="already isolated", audit_id=audit_id)
    refusal = None if body.force else await Guardrails.from_settings(settings).fraction_refusal(
        conn)
    if refusal:
        await audit(conn, decision="refused", reason=f"{body.reason} (refused: {refusal})",
                    dry_run=body.dry_run, **common)
        await session.commit()
        raise HTTPException(status.HTTP_409_CONFLICT, refusal)
    if body.dry_run:
        audit_id = await audit(conn, decision="dry-run", reason=body.reason, dry_run=True,
                               **common)
        await session.commit()
        return IsolationResult(node=node_id, decision="dry-run", state=state,
                               reason="would isolate", audit_id=audit_id)
    audit_id = await apply_isolation(
        conn, node_id, reason=body.reason, actor=principal.name,
        actuators=external_actuators(settings),
        actuator_dry_run={"slurm": settings.slurm_dry_run,
                          "kubernetes": settings.kubernetes_dry_run},
        rule="manual" + (" (forced)" if body.force else ""),
    )
    await webhooks.enqueue(
        conn, "node.isolated", kind="node-isolated", severity="warning", node=node_id,
        action={"decision": "isolated", "reason": body.reason, "rule": "manual",
                "node": node_id, "incident": None, "actor": principal.name},
    )
    await session.commit()
    return IsolationResult(node=node_id, decision="isolated", state="isolated",
                           reason=body.reason, audit_id=audit_id)


@router.post("/api/v1/nodes/{node_id}/release", response_model=IsolationResult, tags=["nodes"])
async def release_node(
    node_id: str,
    body: ReleaseRequest,
    session: SessionDep,
    settings: SettingsDep,
    principal: Principal = require("isolate"),
) -> IsolationResult:
    """Put an isolated node back into scheduling, with a reason."""
    conn = await session.connection()
    await lock_isolation(conn)
    await _node_or_404(session, node_id)
    state = (
        await conn.execute(text("SELECT state FROM nodes WHERE id = :n FOR UPDATE"),
                           {"n": node_id})
    ).scalar_one()
    common = {"node": node_id, "action": "release", "actor": principal.name}
    if state != "isolated":
        audit_id = await audit(conn, decision="not-isolated", reason=body.reason, **common)
        await session.commit()
        return IsolationResult(node=node_id, decision="unchanged", state=state,
                               reason="not isolated", audit_id=audit_id)
    if body.dry_run:
        audit_id = await audit(conn, decision="dry-run", reason=body.reason, dry_run=True,
                               **common)
        await session.commit()
        return IsolationResult(node=node_id, decision="dry-run", state=state,
                               reason="would release", audit_id=audit_id)
    audit_id = await apply_release(
        conn, node_id, reason=body.reason, actor=principal.name,
        actuators=external_actuators(settings),
        actuator_dry_run={"slurm": settings.slurm_dry_run,
                          "kubernetes": settings.kubernetes_dry_run},
    )
    await webhooks.enqueue(
        conn, "node.released", kind="node-released", severity="info", node=node_id,
        action={"decision": "released", "reason": body.reason, "rule": "manual",
                "node": node_id, "incident": None, "actor": principal.name},
    )
    await session.commit()
    return IsolationResult(node=node_id, decision="released", state="active",
                           reason=body.reason, audit_id=audit_id)


@router.get("/api/v1/audit", response_model=list[AuditOut], tags=["isolation"])
async def list_audit(
    session: SessionDep,
    principal: Principal = require("read"),
    node: str | None = None,
    incident: int | None = None,
    decision: str | None = None,
    limit: int = Query(100, ge=1, le=1000),
) -> list[Any]:
    """The isolation audit log, newest first: what, why, which incident, rule, by whom."""
    where, params = ["true"], {}
    for col, val in (("node", node), ("incident_id", incident), ("decision", decision)):
        if val is not None:
            where.append(f"{col} = :{col}")
            params[col] = val
    return await _audit_rows(session, " AND ".join(where), params, limit)


@router.get("/api/v1/incidents/{incident_id}/actions", response_model=IncidentActionsOut,
            tags=["incidents"])
async def incident_actions(
    incident_id: int, session: SessionDep, principal: Principal = require("read")
) -> dict[str, Any]:
    """What was decided and done about one incident: audit rows and actuator attempts."""
    exists = (
        await session.execute(text("SELECT 1 FROM incidents WHERE id = :i"), {"i": incident_id})
    ).first()
    if exists is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no incident {incident_id}")
    params = {"i": incident_id}
    return {
        "incident_id": incident_id,
        "audit": await _audit_rows(session, "incident_id = :i", params, 1000),
        "actuations": await _actuation_rows(session, "incident_id = :i", params, 1000),
    }
