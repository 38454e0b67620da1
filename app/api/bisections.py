"""Bisections: find the slow node(s) among a set by benchmarking groups of them.

``POST /api/v1/bisections`` starts one (role ``isolate``; ``admin`` for the
``command`` benchmark, which runs an operator's program on every node). The
first round's tasks are handed out at once; the driver
(``app.analysis.bisect_driver``) does the rest. ``GET /api/v1/bisections/{id}``
shows every round, group, member figure and the verdict.
``POST /api/v1/incidents/{id}/bisect`` (role ``isolate``) starts one over the
nodes of the job an incident names (a straggler's or a hang's).
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, status
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from sqlalchemy import text

from agents.protocol import Ident
from app.analysis.bisect import DEFAULT_BASELINE_GROUPS, BisectionState, start
from app.analysis.bisect_driver import DEFAULT_RING_PORT, step
from app.api.deps import Principal, SessionDep, require
from app.api.tasks import as_json

router = APIRouter(prefix="/api/v1/bisections", tags=["bisections"])

CREATE_LOCK = 0x6D770003  # serialises the "node already in a running bisection" check
UNPROCESSABLE = 422  # (Starlette renamed the constant; the number is stable)


class NetRingParams(BaseModel):
    """Each member streams ``nbytes`` over TCP to the next member of the ring."""

    model_config = ConfigDict(extra="forbid")
    nbytes: int = Field(1 << 30, ge=1 << 10, le=1 << 36)
    port: int = Field(DEFAULT_RING_PORT, ge=1, le=65535, description="TCP port members listen on")


class GemmParams(BaseModel):
    """Each member multiplies ``size`` x ``size`` matrices for ``seconds``."""

    model_config = ConfigDict(extra="forbid")
    size: int = Field(4096, ge=16, le=65536)
    seconds: float = Field(5.0, gt=0, le=600)


class CommandParams(BaseModel):
    """Each member runs ``argv``; ``pattern``'s first group (or ``figure``) is the number."""

    model_config = ConfigDict(extra="forbid")
    argv: list[Annotated[str, StringConstraints(min_length=1, max_length=4096,
                                                pattern=r"^[^\x00]*$")]] = Field(
        min_length=1, max_length=256
    )
    pattern: Annotated[str, StringConstraints(min_length=1, max_length=1024)]

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            regex = re.compile(v, re.MULTILINE)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from None
        if regex.groups < 1:
            raise ValueError("the pattern needs a group that captures the figure")
        return v


PARAMS: dict[str, type[BaseModel]] = {
    "net-ring": NetRingParams, "gemm": GemmParams, "command": CommandParams
}


class BisectionIn(BaseModel):
    """A bisection request."""

    model_config = ConfigDict(extra="forbid")
    nodes: list[Ident] = Field(min_length=1, max_length=100_000)
    benchmark: Literal["net-ring", "gemm", "command"]
    threshold: float = Field(gt=0, lt=1, description="fraction worse than baseline that is slow")
    higher_is_better: bool = True
    spec: dict[str, Any] = Field(default_factory=dict, description="the benchmark's parameters")
    deadline_s: float = Field(120.0, ge=1, le=3600, description="per round, for every member")
    baseline: float | None = Field(None, gt=0, description="a known healthy group figure")
    baseline_groups: int = Field(DEFAULT_BASELINE_GROUPS, ge=1, le=1024)


class TaskView(BaseModel):
    id: int
    node: str
    state: str
    figure: float | None
    error: str | None
    detail: dict[str, Any]


class GroupView(BaseModel):
    id: str
    members: list[str]
    subjects: list[str]
    parent: str | None
    status: str
    figure: float | None
    ratio: float | None
    tasks: list[TaskView]


class RoundView(BaseModel):
    index: int
    kind: str
    deadline: datetime | None
    groups: list[GroupView]


class BisectionSummary(BaseModel):
    id: int
    status: str
    benchmark: str
    nodes: list[str]
    threshold: float
    higher_is_better: bool
    baseline: float | None
    rounds_after_baseline: int
    suspects: list[str]
    verdict: dict[str, Any] | None
    created_by: str
    created_at: datetime
    updated_at: datetime


class BisectionOut(BisectionSummary):
    spec: dict[str, Any]
    rounds: list[RoundView]


def _summary(row: Any) -> dict[str, Any]:
    state = as_json(row.state)
    rounds = state.get("rounds", [])
    return {
        "id": row.id,
        "status": row.status,
        "benchmark": state.get("benchmark"),
        "nodes": state.get("nodes", []),
        "threshold": state.get("threshold"),
        "higher_is_better": state.get("higher_is_better", True),
        "baseline": state.get("baseline"),
        "rounds_after_baseline": max(0, len(rounds) - 1),
        "suspects": state.get("suspects", []),
        "verdict": state.get("verdict"),
        "created_by": row.created_by,
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


async def _load(session: SessionDep, bisection_id: int) -> BisectionOut:
    row = (
        await session.execute(
            text("SELECT id, state, status, spec, created_by, created_at, updated_at"
                 " FROM bisections WHERE id = :id"),
            {"id": bisection_id},
        )
    ).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no bisection {bisection_id}")
    tasks = await session.execute(
        text("SELECT id, node, round, group_id, state, result, deadline FROM tasks"
             " WHERE bisection_id = :b ORDER BY id"),
        {"b": bisection_id},
    )
    by_group: dict[tuple[int, str], list[Any]] = {}
    for t in tasks:
        by_group.setdefault((t.round, t.group_id), []).append(t)
    state = as_json(row.state)
    baseline = state.get("baseline")
    rounds = []
    for r in state.get("rounds", []):
        groups, deadlines = [], []
        for g in r["groups"]:
            views = []
            for t in by_group.get((r["index"], g["id"]), []):
                deadlines.append(t.deadline)
                result = as_json(t.result) or {}
                views.append(TaskView(id=t.id, node=t.node, state=t.state,
                                      figure=result.get("figure"), error=result.get("error"),
                                      detail=result.get("detail") or {}))
            figure = g.get("figure")
            groups.append(GroupView(
                id=g["id"], members=g["members"], subjects=g["subjects"], parent=g.get("parent"),
                status=g["status"], figure=figure,
                ratio=round(figure / baseline, 4) if figure is not None and baseline else None,
                tasks=views,
            ))
        rounds.append(RoundView(index=r["index"], kind=r["kind"],
                                deadline=max(deadlines) if deadlines else None, groups=groups))
    return BisectionOut(**_summary(row), spec=as_json(row.spec) or {}, rounds=rounds)


@router.post("", response_model=BisectionOut, status_code=status.HTTP_201_CREATED)
async def create_bisection(
    body: BisectionIn, session: SessionDep, principal: Principal = require("isolate")
) -> BisectionOut:
    """Start a bisection over ``nodes``; its first round's tasks go out at once."""
    if body.benchmark == "command" and not principal.can("admin"):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, "the command benchmark runs a program on every node: admin"
        )
    try:
        params = PARAMS[body.benchmark].model_validate(body.spec).model_dump()
    except ValueError as exc:
        raise HTTPException(UNPROCESSABLE, f"spec: {exc}") from None
    try:
        state: BisectionState = start(
            body.nodes, body.benchmark, body.threshold, body.higher_is_better,
            baseline=body.baseline, baseline_groups=body.baseline_groups,
        )
    except ValueError as exc:
        raise HTTPException(UNPROCESSABLE, str(exc)) from None
    if state.done:
        reason = state.verdict.reason if state.verdict else "cannot start"
        raise HTTPException(UNPROCESSABLE, reason)
    await session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": CREATE_LOCK})
    known = {r[0] for r in await session.execute(
        text("SELECT id FROM nodes WHERE id = ANY(:ids)"), {"ids": body.nodes})}
    unknown = [n for n in body.nodes if n not in known]
    if unknown:
        raise HTTPException(UNPROCESSABLE,
                            f"nodes not registered: {', '.join(unknown[:20])}")
    wanted = set(body.nodes)
    for other_id, other_nodes in await session.execute(
        text("SELECT id, state->'nodes' FROM bisections WHERE status = 'running'")
    ):
        busy = wanted & set(as_json(other_nodes))
        if busy:
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"bisection {other_id} is running on {', '.join(sorted(busy)[:20])}",
            )
    spec = {"params": params, "deadline_s": body.deadline_s}
    bisection_id = (
        await session.execute(
            text("INSERT INTO bisections (state, spec, created_by) VALUES"
                 " (CAST(:state AS jsonb), CAST(:spec AS jsonb), :by) RETURNING id"),
            {"state": json.dumps(state.to_json()), "spec": json.dumps(spec),
             "by": principal.name},
        )
    ).scalar_one()
    conn = await session.connection()
    await step(conn, bisection_id)
    await session.commit()
    return await _load(session, bisection_id)


@router.get("", response_model=list[BisectionSummary])
async def list_bisections(
    session: SessionDep,
    principal: Principal = require("read"),
    status_: Literal["running", "done", "error"] | None = Query(None, alias="status"),
    limit: int = Query(100, ge=1, le=1000),
) -> list[dict[str, Any]]:
    """List bisections, newest first, with their verdicts."""
    sql = "SELECT id, state, status, created_by, created_at, updated_at FROM bisections"
    params: dict[str, Any] = {"limit": limit}
    if status_:
        sql += " WHERE status = :status"
        params["status"] = status_
    sql += " ORDER BY id DESC LIMIT :limit"
    return [_summary(r) for r in await session.execute(text(sql), params)]


@router.get("/{bisection_id}", response_model=BisectionOut)
async def get_bisection(
    bisection_id: int, session: SessionDep, principal: Principal = require("read")
) -> BisectionOut:
    """One bisection: its rounds, groups, member figures and the verdict."""
    return await _load(session, bisection_id)


incident_router = APIRouter(prefix="/api/v1/incidents", tags=["bisections"])


class IncidentBisectionIn(BaseModel):
    """A bisection over the nodes of an incident's job."""

    model_config = ConfigDict(extra="forbid")
    benchmark: Literal["net-ring", "gemm", "command"] = "gemm"
    # A straggler worth an incident is at least 5 % slow, usually far more.
    threshold: float = Field(
        0.1, gt=0, lt=1, description="fraction worse than baseline that is slow"
    )
    spec: dict[str, Any] = Field(default_factory=dict, description="the benchmark's parameters")


@incident_router.post(
    "/{incident_id}/bisect", response_model=BisectionOut, status_code=status.HTTP_201_CREATED
)
async def bisect_incident(
    incident_id: int,
    body: IncidentBisectionIn,
    session: SessionDep,
    principal: Principal = require("isolate"),
) -> BisectionOut:
    """Start a bisection over the nodes of the job named by an incident's evidence."""
    row = (
        await session.execute(
            text("SELECT evidence->>'job' FROM incidents WHERE id = :id"), {"id": incident_id}
        )
    ).first()
    if row is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no incident {incident_id}")
    job = row[0]
    if not job:
        raise HTTPException(UNPROCESSABLE, f"incident {incident_id} names no job")
    nodes = [
        r[0]
        for r in await session.execute(
            text("SELECT DISTINCT node FROM job_ranks WHERE job = :job ORDER BY node"),
            {"job": job},
        )
    ]
    if not nodes:
        raise HTTPException(UNPROCESSABLE, f"job {job!r} of incident {incident_id} has no ranks")
    request = BisectionIn.model_validate(
        {"nodes": nodes, "benchmark": body.benchmark, "threshold": body.threshold,
         "spec": body.spec}
    )
    return await create_bisection(request, session, principal)
