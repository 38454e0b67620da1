"""Training jobs: a scheduler registers where each rank runs; the hang
detector uses that map to name the node of a rank that stopped.

``POST /api/v1/jobs`` (roles isolate, admin) registers or replaces a job;
``GET /api/v1/jobs`` lists jobs; ``GET /api/v1/jobs/{id}`` shows each rank with
the furthest collective it was seen to reach and its open hang incidents.
``POST /api/v1/jobs/{id}/steps`` takes per-rank step times for the straggler
detector.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query, Response, status
from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import text

from agents.protocol import Ident, ShortText
from app.api.deps import Principal, PrincipalDep, SessionDep, SettingsDep, require
from app.store import partitions

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

JobState = Literal["running", "finished", "failed", "cancelled"]
MAX_RANKS = 100_000
MAX_STEPS = 10_000  # per request: a step of a 10 000-rank job, or many steps of a few ranks
# Events of a job are looked for from an hour before it was registered: clocks
# differ, and a scheduler may register a job after its ranks started.
_SLACK = timedelta(hours=1)


class RankIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rank: Annotated[int, Field(ge=0, le=10_000_000)]
    node: Ident
    gpu: Annotated[int, Field(ge=0, le=255)] | None = None


class JobIn(BaseModel):
    """A training job and where each of its ranks runs."""

    model_config = ConfigDict(extra="forbid")

    id: Ident
    name: ShortText = ""
    state: JobState = "running"
    ranks: list[RankIn] = Field(min_length=1, max_length=MAX_RANKS)

    @model_validator(mode="after")
    def _ranks_unique(self) -> JobIn:
        seen: set[int] = set()
        for r in self.ranks:
            if r.rank in seen:
                raise ValueError(f"rank {r.rank} is placed twice")
            seen.add(r.rank)
        return self


class RankOut(BaseModel):
    rank: int
    node: str
    gpu: int | None
    last_seq: int | None  # the furthest collective sequence number this rank reported
    last_event_at: datetime | None  # its latest NCCL/PyTorch event
    last_event_kind: str | None


class JobSummary(BaseModel):
    id: str
    name: str
    state: str
    created_at: datetime
    updated_at: datetime
    ranks: int
    nodes: int


class JobOut(BaseModel):
    id: str
    name: str
    state: str
    registered_by: str | None
    created_at: datetime
    updated_at: datetime
    ranks: list[RankOut]
    open_incidents: list[dict[str, Any]]


@router.post("", response_model=JobSummary, status_code=status.HTTP_201_CREATED)
async def register_job(
    job: JobIn,
    session: SessionDep,
    response: Response,
    principal: Principal = require("isolate"),
) -> dict[str, Any]:
    """Register a job's rank map (rank -> node, GPU); posting an existing id replaces it."""
    created = (
        await session.execute(
            text(
                "INSERT INTO jobs (id, name, state, registered_by) VALUES (:id, :name, :state, :by)"
                " ON CONFLICT (id) DO UPDATE SET name = excluded.name, state = excluded.state,"
                " registered_by = excluded.registered_by, updated_at = now()"
                " RETURNING (xmax = 0)"
            ),
            {"id": job.id, "name": job.name, "state": job.state, "by": principal.name},
        )
    ).scalar()
    # A replaced map keeps the progress of ranks that stay on the same node.
    await session.execute(
        text(
            "DELETE FROM job_ranks r USING unnest(CAST(:ranks AS integer[]),"
            " CAST(:nodes AS text[])) AS v(rank, node)"
            " WHERE r.job = :id AND r.rank = v.rank AND r.node <> v.node"
        ),
        {"id": job.id, "ranks": [r.rank for r in job.ranks], "nodes": [r.node for r in job.ranks]},
    )
    await session.execute(
        text("DELETE FROM job_ranks WHERE job = :id AND NOT (rank = ANY(:ranks))"),
        {"id": job.id, "ranks": [r.rank for r in job.ranks]},
    )
    await session.execute(
        text(
            "INSERT INTO job_ranks (job, rank, node, gpu)"
            " SELECT :id, v.rank, v.node, v.gpu FROM unnest(CAST(:ranks AS integer[]),"
            " CAST(:nodes AS text[]), CAST(:gpus AS smallint[])) AS v(rank, node, gpu)"
            " ON CONFLICT (job, rank) DO UPDATE SET gpu = excluded.gpu"
        ),
        {
            "id": job.id,
            "ranks": [r.rank for r in job.ranks],
            "nodes": [r.node for r in job.ranks],
            "gpus": [r.gpu for r in job.ranks],
        },
    )
    row = (await session.execute(text(_SUMMARY + " WHERE j.id = :id"), {"id": job.id})).one()
    await session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    return dict(row._mapping)


_SUMMARY = (
    "SELECT j.id, j.name, j.state, j.created_at, j.updated_at,"
    " (SELECT count(*) FROM job_ranks r WHERE r.job = j.id) AS ranks,"
    " (SELECT count(DISTINCT node) FROM job_ranks r WHERE r.job = j.id) AS nodes"
    " FROM jobs j"
)


@router.get("", response_model=list[JobSummary])
async def list_jobs(
    session: SessionDep,
    principal: Principal = require("read"),
    state: JobState | None = None,
    limit: int = Query(100, ge=1, le=1000),
) -> list[dict[str, Any]]:
    """List registered jobs, newest first; filter by state."""
    where = " WHERE j.state = :state" if state else ""
    rows = await session.execute(
        text(_SUMMARY + where + " ORDER BY j.created_at DESC, j.id LIMIT :limit"),
        {"state": state, "limit": limit},
    )
    return [dict(r._mapping) for r in rows]


@router.get("/{job_id:path}", response_model=JobOut)
async def get_job(
    job_id: str, session: SessionDep, principal: Principal = require("read")
) -> dict[str, Any]:
    """One job: each rank's node, GPU and last reported progress; its open hang incidents."""
    job = (
        await session.execute(
            text(
                "SELECT id, name, state, registered_by, created_at, updated_at FROM jobs"
                " WHERE id = :id"
            ),
            {"id": job_id},
        )
    ).first()
    if job is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    # Progress from the job's NCCL/PyTorch events, merged with what the hang
    # detector kept on job_ranks (which outlives the events' retention).
    rows = await session.execute(
        text(
            "WITH ev AS ("
            "  SELECT DISTINCT ON (rank) rank, ts, kind FROM events"
            "  WHERE job = :id AND rank IS NOT NULL AND ts >= :since"
            "  ORDER BY rank, ts DESC),"
            " seqs AS ("
            "  SELECT rank, max(greatest((attrs->>'seq')::bigint,"
            "   (attrs->>'last_enqueued')::bigint)) AS seq FROM events"
            "  WHERE job = :id AND rank IS NOT NULL AND ts >= :since"
            "  AND (attrs ? 'seq' OR attrs ? 'last_enqueued')"
            "  AND coalesce(attrs->>'seq', '0') ~ '^-?[0-9]+$'"
            "  AND coalesce(attrs->>'last_enqueued', '0') ~ '^-?[0-9]+$'"
            "  GROUP BY rank)"
            " SELECT r.rank, r.node, r.gpu,"
            "  CASE WHEN r.last_seq IS NULL THEN s.seq WHEN s.seq IS NULL THEN r.last_seq"
            "   ELSE greatest(r.last_seq, s.seq) END AS last_seq,"
            "  ev.ts AS last_event_at, ev.kind AS last_event_kind"
            " FROM job_ranks r LEFT JOIN ev ON ev.rank = r.rank"
            " LEFT JOIN seqs s ON s.rank = r.rank"
            " WHERE r.job = :id ORDER BY r.rank"
        ),
        {"id": job_id, "since": job.created_at - _SLACK},
    )
    ranks = [dict(r._mapping) for r in rows]
    incidents = await session.execute(
        text(
            "SELECT id, key, summary, primary_node, opened_at FROM incidents"
            " WHERE state = 'open' AND detector = 'hang' AND evidence->>'job' = :id"
            " ORDER BY opened_at DESC"
        ),
        {"id": job_id},
    )
    return {
        **dict(job._mapping),
        "ranks": ranks,
        "open_incidents": [dict(i._mapping) for i in incidents],
    }



class StepIn(BaseModel):
    """One rank's compute time of one step (its time before the step's collective)."""

    model_config = ConfigDict(extra="forbid")

    rank: Annotated[int, Field(ge=0, le=10_000_000)]
    step: Annotated[int, Field(ge=0, le=2**62)]
    duration_s: Annotated[float, Field(ge=0, le=86_400, allow_inf_nan=False)]
    ts: AwareDatetime


class StepsIn(BaseModel):
    """Step times of some ranks of one job."""

    model_config = ConfigDict(extra="forbid")

    steps: list[StepIn] = Field(min_length=1, max_length=MAX_STEPS)

    @model_validator(mode="after")
    def _steps_unique(self) -> StepsIn:
        seen: set[tuple[int, int]] = set()
        for s in self.steps:
            if (s.rank, s.step) in seen:
                raise ValueError(f"step {s.step} of rank {s.rank} is given twice")
            seen.add((s.rank, s.step))
        return self


class StepsAccepted(BaseModel):
    job: str
    steps: int


def _step_error(i: int, field: str, msg: str, kind: str) -> dict[str, Any]:
    return {"loc": ["body", "steps", i, field], "field": f"steps[{i}].{field}", "msg": msg,
            "type": kind}


@router.post("/{job_id:path}/steps", response_model=StepsAccepted)
async def post_steps(
    job_id: str,
    body: StepsIn,
    session: SessionDep,
    settings: SettingsDep,
    principal: PrincipalDep,
) -> dict[str, Any]:
    """Record per-rank step times of a job (a node hosting one of the ranks, isolate, admin)."""
    if principal.role != "node" and not principal.can("isolate"):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN, f"role {principal.role!r} may not post steps"
        )
    job = await session.execute(text("SELECT 1 FROM jobs WHERE id = :id"), {"id": job_id})
    if job.first() is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"no job {job_id!r}")
    placed: dict[int, str] = dict(
        (
            await session.execute(
                text("SELECT rank, node FROM job_ranks WHERE job = :id AND rank = ANY(:ranks)"),
                {"id": job_id, "ranks": sorted({s.rank for s in body.steps})},
            )
        ).all()
    )
    oldest, _ = partitions.window(settings.retention_days)
    newest = datetime.now(UTC) + timedelta(seconds=settings.max_clock_skew_s)
    errors = []
    for i, s in enumerate(body.steps):
        if s.rank not in placed:
            errors.append(_step_error(i, "rank", f"rank {s.rank} is not in job {job_id!r}'s"
                                      " rank map", "unknown_rank"))
        elif not oldest <= s.ts <= newest:
            errors.append(_step_error(i, "ts", f"timestamp {s.ts.isoformat()} outside"
                                      f" [{oldest.isoformat()}, {newest.isoformat()}]"
                                      " (retention or clock skew)", "time_window"))
        if len(errors) >= 20:
            break
    if errors:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, errors)
    # A job's ranks often report through one of them (rank 0 gathers every
    # rank's timings), so any node the job runs on may post for all its ranks.
    if principal.role == "node" and principal.node not in placed.values():
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            f"node {principal.node!r} hosts none of these ranks of job {job_id!r}",
        )
    await session.execute(
        text(
            "INSERT INTO job_steps (job, rank, step, duration_s, ts)"
            " SELECT :id, v.rank, v.step, v.duration_s, v.ts FROM unnest("
            " CAST(:ranks AS integer[]), CAST(:steps AS bigint[]),"
            " CAST(:durations AS double precision[]), CAST(:ts AS timestamptz[]))"
            " AS v(rank, step, duration_s, ts)"
            " ON CONFLICT (job, rank, step) DO UPDATE SET duration_s = excluded.duration_s,"
            " ts = excluded.ts, received_at = excluded.received_at"
        ),
        {
            "id": job_id,
            "ranks": [s.rank for s in body.steps],
            "steps": [s.step for s in body.steps],
            "durations": [s.duration_s for s in body.steps],
            "ts": [s.ts for s in body.steps],
        },
    )
    await session.commit()
    return {"job": job_id, "steps": len(body.steps)}
