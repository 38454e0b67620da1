"""Agent tasks: benchmark runs the backend hands to agents.

An agent long-polls ``GET /api/v1/agents/{node}/tasks?wait=25``: the call
returns as soon as the node has pending tasks (marking them running), or an
empty list after ``wait`` seconds. Whoever creates tasks sends a PostgreSQL
NOTIFY on ``meshwatch_tasks`` naming the node; every backend replica keeps
one LISTEN connection (:func:`run_task_listener`) and wakes that node's
waiting requests, so a task reaches its agent within milliseconds whichever
replica the agent talks to. Without the listener the wait falls back to a
short poll. A waiting request holds no database connection.

The agent posts ``{"figure": ...}`` or ``{"error": ...}`` to
``/api/v1/agents/{node}/tasks/{id}/result``. Results are accepted until the
task's deadline has been enforced (the task expired); a retried post of the
same result is acknowledged again.

Task kinds and their ``spec`` (see ``agents/tasks.py``, which runs them):

* ``net-ring``: ``{"nbytes", "port", "send_to": {"node", "address", "port"},
  "receive_from", "members"}``: receive ``nbytes`` from the predecessor on
  ``port`` while sending ``nbytes`` to the successor; the figure is the
  Gbit/s of the incoming hop;
* ``gemm``: ``{"size", "seconds"}``: GFLOP/s;
* ``command``: ``{"argv", "pattern"}``: the number ``pattern`` finds in the output.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, HTTPException, Query, Request, status
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.api.deps import PrincipalDep, SessionDep, require_node

log = logging.getLogger(__name__)

router = APIRouter(prefix="/api/v1/agents", tags=["tasks"])

TASKS_CHANNEL = "meshwatch_tasks"  # payload: the node that has new tasks
RESULTS_CHANNEL = "meshwatch_task_results"  # payload: the bisection id a result belongs to
MAX_WAIT_S = 60.0
CLAIM_LIMIT = 16
# A waiting request re-reads its node's tasks this often even without a
# NOTIFY: rarely while the listener runs (a notification lost on a
# reconnect), often when it does not.
RECHECK_LISTENING_S = 5.0
RECHECK_POLLING_S = 0.5

TaskKind = Literal["net-ring", "gemm", "command"]


class TaskOut(BaseModel):
    """One task for an agent to run now."""

    id: int
    kind: TaskKind
    bisection_id: int | None
    deadline: datetime
    timeout_s: float = Field(description="seconds left until the deadline when handed out")
    spec: dict[str, Any]


class TaskResultIn(BaseModel):
    """What the agent measured: a figure, or why it could not."""

    model_config = ConfigDict(extra="forbid")

    figure: Annotated[float, Field(ge=0, le=1e18, allow_inf_nan=False)] | None = None
    error: Annotated[str, Field(max_length=4096, pattern=r"^[^\x00]*$")] | None = None
    detail: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_of(self) -> TaskResultIn:
        if (self.figure is None) == (self.error is None):
            raise ValueError("give exactly one of figure and error")
        return self

    @field_validator("detail")
    @classmethod
    def _detail_storable(cls, v: dict[str, Any]) -> dict[str, Any]:
        encoded = json.dumps(v, allow_nan=False)
        if len(encoded) > 16_384 or "\\u0000" in encoded:
            raise ValueError("detail must be JSON under 16 KiB without NUL characters")
        return v


class TaskResultAck(BaseModel):
    id: int
    state: Literal["done", "failed"]
    duplicate: bool


def as_json(value: Any) -> Any:
    """A jsonb column's value, whether the driver decoded it or not."""
    return json.loads(value) if isinstance(value, str) else value


# -- wake-ups -------------------------------------------------------------------------------


class TaskWaiters:
    """Requests waiting for their node's tasks, woken by the LISTEN connection."""

    def __init__(self) -> None:
        self._by_node: dict[str, set[asyncio.Event]] = {}
        self.listening = False

    def add(self, node: str, event: asyncio.Event) -> None:
        self._by_node.setdefault(node, set()).add(event)

    def discard(self, node: str, event: asyncio.Event) -> None:
        events = self._by_node.get(node)
        if events is not None:
            events.discard(event)
            if not events:
                del self._by_node[node]

    def wake(self, node: str) -> None:
        for event in self._by_node.get(node, ()):
            event.set()

    def wake_all(self) -> None:
        for events in self._by_node.values():
            for event in events:
                event.set()

    @property
    def recheck_s(self) -> float:
        return RECHECK_LISTENING_S if self.listening else RECHECK_POLLING_S


def task_waiters(app: FastAPI) -> TaskWaiters:
    waiters = getattr(app.state, "task_waiters", None)
    if waiters is None:
        waiters = app.state.task_waiters = TaskWaiters()
    return waiters


async def notify_tasks(conn: AsyncConnection, nodes: Iterable[str]) -> None:
    """Tell every replica that these nodes have new tasks (delivered at commit)."""
    for node in sorted(set(nodes)):
        await conn.execute(text("SELECT pg_notify(:c, :n)"), {"c": TASKS_CHANNEL, "n": node})


async def run_task_listener(app: FastAPI) -> None:
    """Background loop: hold a LISTEN connection and wake the waiting long polls."""
    waiters = task_waiters(app)

    def on_notify(_conn: object, _pid: int, _channel: str, payload: str) -> None:
        waiters.wake(payload)

    while True:
        try:
            async with app.state.engine.connect() as conn:
                raw: Any = (await conn.get_raw_connection()).driver_connection
                await raw.add_listener(TASKS_CHANNEL, on_notify)
                waiters.listening = True
                waiters.wake_all()  # anything sent while we were not listening
                try:
                    while not raw.is_closed():
                        await asyncio.sleep(1.0)
                finally:
                    waiters.listening = False
                    if not raw.is_closed():
                        await raw.remove_listener(TASKS_CHANNEL, on_notify)
            raise ConnectionError("task listener connection closed")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("task listener lost its database connection; retrying")
            await asyncio.sleep(1.0)


# -- routes ---------------------------------------------------------------------------------

_CLAIM = text(
    f"""
    UPDATE tasks SET state = 'running', started_at = now()
    WHERE id IN (
        SELECT id FROM tasks
        WHERE node = :node AND state = 'pending' AND deadline > now()
        ORDER BY id LIMIT {CLAIM_LIMIT}
        FOR UPDATE SKIP LOCKED
    )
    RETURNING id, kind, bisection_id, spec, deadline,
              EXTRACT(EPOCH FROM deadline - now())::float8 AS timeout_s
    """
)


async def _claim(app: FastAPI, node: str) -> list[TaskOut]:
    async with app.state.engine.begin() as conn:
        rows = (await conn.execute(_CLAIM, {"node": node})).mappings().all()
    return sorted(
        (
            TaskOut(
                id=r["id"],
                kind=r["kind"],
                bisection_id=r["bisection_id"],
                deadline=r["deadline"],
                timeout_s=max(0.0, float(r["timeout_s"])),
                spec=as_json(r["spec"]),
            )
            for r in rows
        ),
        key=lambda t: t.id,
    )


@router.get("/{node}/tasks", response_model=list[TaskOut])
async def poll_tasks(
    node: str,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    wait: float = Query(0.0, ge=0, le=MAX_WAIT_S, description="seconds to wait for a task"),
) -> list[TaskOut]:
    """An agent's pending tasks (now marked running); waits up to ``wait`` s for one."""
    require_node(principal, node)
    # The token check used a pooled connection: give it back before waiting.
    await session.close()
    app: FastAPI = request.app
    waiters = task_waiters(app)
    event = asyncio.Event()
    waiters.add(node, event)  # before the first read, so no NOTIFY falls between
    give_up_at = time.monotonic() + wait
    try:
        while True:
            event.clear()
            tasks = await _claim(app, node)
            left = give_up_at - time.monotonic()
            if tasks or left <= 0 or await request.is_disconnected():
                return tasks
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(left, waiters.recheck_s))
    finally:
        waiters.discard(node, event)


@router.post("/{node}/tasks/{task_id}/result", response_model=TaskResultAck)
async def post_result(
    node: str,
    task_id: int,
    body: TaskResultIn,
    session: SessionDep,
    principal: PrincipalDep,
) -> TaskResultAck:
    """Report a task's figure or error; a retried identical report is acknowledged again."""
    require_node(principal, node)
    result = {"figure": body.figure, "error": body.error, "detail": body.detail}
    new_state: Literal["done", "failed"] = "done" if body.error is None else "failed"
    row = (
        await session.execute(
            text(
                "SELECT node, state, result, bisection_id FROM tasks WHERE id = :id FOR UPDATE"
            ),
            {"id": task_id},
        )
    ).mappings().first()
    if row is None or row["node"] != node:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"node {node!r} has no task {task_id}")
    if row["state"] in ("done", "failed"):
        if _same_result(as_json(row["result"]), result):
            return TaskResultAck(id=task_id, state=row["state"], duplicate=True)
        raise HTTPException(status.HTTP_409_CONFLICT, f"task {task_id} already has a result")
    if row["state"] == "expired":
        raise HTTPException(
            status.HTTP_409_CONFLICT, f"task {task_id} expired: its deadline passed"
        )
    await session.execute(
        text(
            "UPDATE tasks SET state = :state, result = CAST(:result AS jsonb), "
            "finished_at = now(), started_at = coalesce(started_at, now()) WHERE id = :id"
        ),
        {"state": new_state, "result": json.dumps(result), "id": task_id},
    )
    if row["bisection_id"] is not None:
        await session.execute(
            text("SELECT pg_notify(:c, :b)"),
            {"c": RESULTS_CHANNEL, "b": str(row["bisection_id"])},
        )
    await session.commit()
    return TaskResultAck(id=task_id, state=new_state, duplicate=False)


def _same_result(stored: Any, new: dict[str, Any]) -> bool:
    if not isinstance(stored, dict):
        return False
    a, b = stored.get("figure"), new.get("figure")
    same_figure = (a is None and b is None) or (
        a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-12)
    )
    return same_figure and stored.get("error") == new.get("error")
