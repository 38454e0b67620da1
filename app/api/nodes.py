"""Nodes: enrolment of agents, and the node list that schedulers read."""

from __future__ import annotations

import hmac
import json
import secrets
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from pydantic import BaseModel
from sqlalchemy import select, text

from agents.protocol import RegisterRequest, RegisterResponse
from app.api.deps import Principal, SessionDep, SettingsDep, bearer, hash_token, require
from app.store.models import Node

router = APIRouter(prefix="/api/v1/nodes", tags=["nodes"])


class NodeOut(BaseModel):
    id: str
    hostname: str
    address: str
    probe_port: int
    rack: str | None
    pod: str | None
    gpu_count: int
    labels: dict[str, Any]
    state: str
    schedulable: bool
    registered_at: datetime
    last_seen: datetime | None
    telemetry_age_s: float | None


def node_out(n: Node, now: datetime | None = None) -> NodeOut:
    now = now or datetime.now(UTC)
    return NodeOut(
        id=n.id,
        hostname=n.hostname,
        address=n.address,
        probe_port=n.probe_port,
        rack=n.rack,
        pod=n.pod,
        gpu_count=n.gpu_count,
        labels=n.labels,
        state=n.state,
        schedulable=n.state == "active",
        registered_at=n.registered_at,
        last_seen=n.last_seen,
        telemetry_age_s=(now - n.last_seen).total_seconds() if n.last_seen else None,
    )


@router.post("/register", response_model=RegisterResponse)
async def register(
    body: RegisterRequest, request: Request, session: SessionDep, settings: SettingsDep
) -> RegisterResponse:
    """Enrol a node with the bootstrap token; returns the node's own token.

    Re-registering keeps the node's identity and history and issues a new
    token (the previous one stops working).
    """
    token = bearer(request)
    if not settings.bootstrap_token or not hmac.compare_digest(token, settings.bootstrap_token):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid bootstrap token")
    node_token = secrets.token_urlsafe(32)
    await session.execute(
        text(
            """
            INSERT INTO nodes (id, hostname, address, probe_port, rack, pod, gpu_count, labels,
                               token_hash)
            VALUES (:id, :hostname, :address, :probe_port, :rack, :pod, :gpu_count,
                    CAST(:labels AS jsonb), :token_hash)
            ON CONFLICT (id) DO UPDATE SET
                hostname = EXCLUDED.hostname, address = EXCLUDED.address,
                probe_port = EXCLUDED.probe_port, rack = EXCLUDED.rack, pod = EXCLUDED.pod,
                gpu_count = EXCLUDED.gpu_count, labels = EXCLUDED.labels,
                token_hash = EXCLUDED.token_hash
            """
        ),
        {
            "id": body.node,
            "hostname": body.hostname,
            "address": body.address,
            "probe_port": body.probe_port,
            "rack": body.rack,
            "pod": body.pod,
            "gpu_count": body.gpu_count,
            "labels": json.dumps(body.labels),
            "token_hash": hash_token(node_token),
        },
    )
    await session.commit()
    return RegisterResponse(node=body.node, token=node_token)


@router.get("", response_model=list[NodeOut])
async def list_nodes(
    session: SessionDep,
    principal: Principal = require("read"),
    schedulable: bool | None = Query(None, description="only nodes a scheduler may use (or not)"),
    rack: str | None = None,
) -> list[NodeOut]:
    """List nodes with their state and the age of their last telemetry."""
    q = select(Node).order_by(Node.id)
    if schedulable is not None:
        q = q.where((Node.state == "active") if schedulable else (Node.state != "active"))
    if rack is not None:
        q = q.where(Node.rack == rack)
    now = datetime.now(UTC)
    return [node_out(n, now) for n in (await session.execute(q)).scalars()]
