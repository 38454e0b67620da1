"""The bisection driver: turns the pure state machine of ``app.analysis.bisect``
into agent tasks and back.

For every running bisection, :func:`step` (one transaction, the bisection's
row locked ``FOR UPDATE``):

1. creates one task per member of each pending group of the current round
   that has none yet (a ``net-ring`` member is told its port, its successor's
   address and port), and NOTIFYs the members' agents;
2. folds finished groups into ``record()``: every member done gives the group
   figure (the worst member or hop, ``group_figure``); one member failed or
   expired fails the group;
3. past the round's deadline, expires the tasks still out and calls
   ``expire_round()``;
4. calls ``advance()`` and, when a new round began, goes back to 1;
5. writes the state JSON back in the same transaction.

The state lives only in Postgres, so a restarted backend (or another
replica) picks up where the last one stopped. Row locks make ``step`` safe
from anywhere; :class:`BisectionDriver` runs it on one replica at a time
(advisory lock, as the analysis engine does), woken at once by NOTIFY when a
result arrives and once a second for deadlines. A freshly started leader
waits ``resume_grace_s`` before expiring anything, so agents that finished
while no backend was up can hand in their results first.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from app.analysis.bisect import (
    BisectionGroup,
    BisectionState,
    advance,
    expire_round,
    group_figure,
    record,
)
from app.analysis.leadership import Leadership
from app.api.tasks import RESULTS_CHANNEL, as_json, notify_tasks

log = logging.getLogger(__name__)

DRIVER_LOCK = 0x6D770002
TICK_S = 1.0
RESUME_GRACE_S = 10.0
DEFAULT_RING_PORT = 7471
RING_PORT_LABEL = "ring_port"  # a node label that overrides the bisection's ring port
MAX_STEPS = 64  # rounds one step may run through (each needs answers, so few ever do)


def member_specs(
    benchmark: str,
    members: Sequence[str],
    params: Mapping[str, Any],
    nodes: Mapping[str, Mapping[str, Any]],
) -> dict[str, dict[str, Any]]:
    """The task spec of each member of one group.

    ``nodes`` maps a node id to its ``address`` and ``labels``. In a net-ring
    each member receives from its predecessor on its own port and sends to
    its successor: the port is the node's ``ring_port`` label if it has one
    (several test nodes on one host), else ``params["port"]``.
    """
    if benchmark != "net-ring":
        return {n: dict(params) for n in members}

    def port_of(node: str) -> int:
        labels = nodes[node].get("labels") or {}
        return int(labels.get(RING_PORT_LABEL, params.get("port", DEFAULT_RING_PORT)))

    specs = {}
    for i, node in enumerate(members):
        succ = members[(i + 1) % len(members)]
        specs[node] = {
            "nbytes": int(params["nbytes"]),
            "port": port_of(node),
            "send_to": {"node": succ, "address": nodes[succ]["address"], "port": port_of(succ)},
            "receive_from": members[i - 1],
            "members": list(members),
        }
    return specs


async def _node_info(conn: AsyncConnection, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    rows = await conn.execute(
        text("SELECT id, address, labels FROM nodes WHERE id = ANY(:ids)"), {"ids": list(ids)}
    )
    return {r.id: {"address": r.address, "labels": as_json(r.labels)} for r in rows}


async def _dispatch(
    conn: AsyncConnection,
    bisection_id: int,
    state: BisectionState,
    groups: Sequence[BisectionGroup],
    spec: Mapping[str, Any],
) -> list[str]:
    """Create the tasks of ``groups``; a group with an unknown member fails at once."""
    assert state.current_round is not None
    nodes = await _node_info(conn, [n for g in groups for n in g.members])
    woken: list[str] = []
    for g in groups:
        missing = [n for n in g.members if n not in nodes]
        if missing:
            log.warning(
                "bisection %s group %s: nodes %s are not registered; the group fails",
                bisection_id,
                g.id,
                ", ".join(missing),
            )
            record(state, g.members, None)
            continue
        specs = member_specs(state.benchmark, g.members, spec.get("params", {}), nodes)
        for node in g.members:
            task_spec = {**specs[node], "bisection": bisection_id, "group": g.id}
            await conn.execute(
                text(
                    "INSERT INTO tasks (node, bisection_id, round, group_id, kind, spec, deadline)"
                    " VALUES (:node, :b, :round, :group, :kind, CAST(:spec AS jsonb),"
                    " now() + make_interval(secs => :deadline_s))"
                ),
                {
                    "node": node,
                    "b": bisection_id,
                    "round": state.current_round.index,
                    "group": g.id,
                    "kind": state.benchmark,
                    "spec": json.dumps(task_spec),
                    "deadline_s": float(spec.get("deadline_s", 60.0)),
                },
            )
            woken.append(node)
    return woken


async def step(conn: AsyncConnection, bisection_id: int, *, expire_grace_s: float = 0.0) -> bool:
    """Move one bisection on as far as the answers in hand allow; True if it changed.

    Runs inside the caller's transaction and locks the bisection's row.
    ``expire_grace_s`` postpones expiring a round by that many seconds.
    """
    row = (
        await conn.execute(
            text("SELECT state, status, spec FROM bisections WHERE id = :id FOR UPDATE"),
            {"id": bisection_id},
        )
    ).first()
    if row is None or row.status != "running":
        return False
    try:
        state = BisectionState.from_json(as_json(row.state))
    except (ValueError, KeyError, TypeError) as exc:
        log.error("bisection %s: unreadable state (%s); marked error", bisection_id, exc)
        await conn.execute(
            text("UPDATE bisections SET status = 'error', updated_at = now() WHERE id = :id"),
            {"id": bisection_id},
        )
        return True
    spec = as_json(row.spec) or {}
    changed = False
    woken: list[str] = []
    for _ in range(MAX_STEPS):
        current = state.current_round
        if state.done or current is None:
            break
        tasks = (
            await conn.execute(
                text(
                    "SELECT group_id, state, result,"
                    " deadline + make_interval(secs => :grace) < now() AS overdue"
                    " FROM tasks WHERE bisection_id = :b AND round = :r"
                ),
                {"b": bisection_id, "r": current.index, "grace": expire_grace_s},
            )
        ).all()
        by_group: dict[str, list[Any]] = {}
        for t in tasks:
            by_group.setdefault(t.group_id, []).append(t)
        pending = [g for g in current.groups if g.status == "pending"]
        fresh = [g for g in pending if g.id not in by_group]
        if fresh:
            woken += await _dispatch(conn, bisection_id, state, fresh, spec)
            changed = True
        for g in pending:
            group_tasks = by_group.get(g.id)
            if not group_tasks or g.status != "pending":
                continue
            states = {t.state for t in group_tasks}
            if states & {"failed", "expired"}:
                record(state, g.members, None)
                changed = True
            elif states == {"done"}:
                figures = [as_json(t.result).get("figure") for t in group_tasks]
                record(state, g.members, group_figure(figures, state.higher_is_better))
                changed = True
        overdue = tasks and all(t.overdue for t in tasks)
        if overdue and not current.complete:
            await conn.execute(
                text(
                    "UPDATE tasks SET state = 'expired', finished_at = now()"
                    " WHERE bisection_id = :b AND round = :r AND state IN ('pending', 'running')"
                ),
                {"b": bisection_id, "r": current.index},
            )
            expire_round(state)
            changed = True
        if not advance(state):
            break
        changed = True
        # Members of a group that failed early may still be out: they are no longer awaited.
        await conn.execute(
            text(
                "UPDATE tasks SET state = 'expired', finished_at = now()"
                " WHERE bisection_id = :b AND round <= :r AND state IN ('pending', 'running')"
            ),
            {"b": bisection_id, "r": current.index},
        )
    if changed:
        await conn.execute(
            text(
                "UPDATE bisections SET state = CAST(:state AS jsonb), status = :status,"
                " updated_at = now() WHERE id = :id"
            ),
            {
                "state": json.dumps(state.to_json()),
                "status": "done" if state.done else "running",
                "id": bisection_id,
            },
        )
        if state.done and state.verdict is not None:
            log.warning("bisection %s finished: %s", bisection_id, state.verdict.reason)
    if woken:
        await notify_tasks(conn, woken)
    return changed


class BisectionDriver:
    """Steps every running bisection: at once on a result, else once a second."""

    def __init__(self, engine: AsyncEngine, resume_grace_s: float = RESUME_GRACE_S) -> None:
        self.engine = engine
        self.resume_grace_s = resume_grace_s
        self._leadership: Leadership | None = None
        self._wake = asyncio.Event()
        self._leader_since = 0.0

    def wake(self, *_args: object) -> None:
        self._wake.set()

    async def step_all(self) -> int:
        """One pass over the running bisections; returns how many changed."""
        grace = max(0.0, self._leader_since + self.resume_grace_s - time.monotonic())
        async with self.engine.connect() as conn:
            ids = [
                r[0]
                for r in await conn.execute(
                    text("SELECT id FROM bisections WHERE status = 'running' ORDER BY id")
                )
            ]
        changed = 0
        for bisection_id in ids:
            try:
                async with self.engine.begin() as conn:
                    changed += await step(conn, bisection_id, expire_grace_s=grace)
            except Exception:
                # One broken bisection must not stall the others.
                log.exception("bisection %s: step failed; retried next tick", bisection_id)
        return changed

    async def run(self) -> None:
        """Forever: become the leader when possible, then step on every wake-up or tick."""
        leadership = Leadership(
            self.engine, DRIVER_LOCK, RESULTS_CHANNEL, self.wake, "bisection driver"
        )
        self._leadership = leadership
        await leadership.run(self._lead_from_start)

    @property
    def is_leader(self) -> bool:
        return self._leadership is not None and self._leadership.is_leader

    async def _lead_from_start(self, raw: Any) -> None:
        self._leader_since = time.monotonic()
        await self._lead(raw)

    async def _lead(self, raw: Any) -> None:
        while True:
            if raw.is_closed():
                raise ConnectionError("leader connection closed")
            self._wake.clear()
            await self.step_all()
            try:
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            except TimeoutError:
                pass


async def run_bisections(app: FastAPI) -> None:
    """Background loop of the app: drive every running bisection."""
    driver = BisectionDriver(app.state.engine)
    app.state.bisection_driver = driver
    await driver.run()
