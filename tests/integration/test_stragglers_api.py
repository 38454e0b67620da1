"""Passive straggler detection end to end: step times posted to the real server,
the stragglers detector run against the same PostgreSQL as the engine runs it,
and a bisection started from the incident it opens."""

from __future__ import annotations

import random
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.analysis.detectors import StragglersDetector
from app.analysis.engine import AnalysisEngine
from app.analysis.stragglers import THROTTLE_HW_SLOWDOWN
from app.api.deps import hash_token
from app.lab.processes import BackendProcess
from tests.integration.test_jobs_hang import Cluster, tag

RANKS = 8
STEP_S = 2.0  # seconds between steps
BASE_S = 1.0  # a healthy rank's compute time per step


async def make_token(db: Any, role: str) -> dict[str, str]:
    token = secrets.token_urlsafe(16)
    await db.execute("INSERT INTO api_tokens (name, role, token_hash) VALUES ($1, $2, $3)",
                     f"{role}-{tag()}", role, hash_token(token))
    return {"Authorization": f"Bearer {token}"}


async def eight_rank_job(cluster: Cluster, prefix: str) -> tuple[str, list[str]]:
    """A job of 8 ranks, two per node on four nodes: rank r runs on node r // 2."""
    t = tag()
    nodes = [f"{prefix}{i}-{t}" for i in range(RANKS // 2)]
    await cluster.register(*nodes)
    job = f"{prefix}job-{t}"
    await cluster.register_job(job, {r: (nodes[r // 2], r % 2) for r in range(RANKS)})
    return job, nodes


def step_times(
    steps: int, slow: dict[int, set[int]], factor: float = 1.3, seed: int = 7
) -> list[dict[str, Any]]:
    """``steps`` steps of every rank ending now; rank r is ``factor`` slower in steps slow[r].

    Healthy ranks jitter by up to 2 %, as compute times of equal shards do.
    """
    rng = random.Random(seed)
    end = datetime.now(UTC)
    out = []
    for step in range(steps):
        ts = end - timedelta(seconds=STEP_S * (steps - 1 - step))
        for rank in range(RANKS):
            duration = BASE_S * (1 + rng.uniform(-0.02, 0.02))
            if step in slow.get(rank, ()):
                duration *= factor
            out.append({"rank": rank, "step": step, "duration_s": round(duration, 6),
                        "ts": ts.isoformat()})
    return out


async def post_steps(cluster: Cluster, job: str, node: str, steps: list[dict[str, Any]]) -> None:
    """Post as the job's ranks do when rank 0 gathers every rank's timings: from one node."""
    for i in range(0, len(steps), 100):
        r = await cluster.client.post(
            f"/api/v1/jobs/{job}/steps",
            headers={"Authorization": f"Bearer {cluster.tokens[node]}"},
            json={"steps": steps[i : i + 100]},
        )
        assert r.status_code == 200, r.text
        assert r.json() == {"job": job, "steps": len(steps[i : i + 100])}


async def straggler_incidents(engine: AsyncEngine, job: str) -> list[dict[str, Any]]:
    # settle_s=0: every row was committed before the cycle starts.
    await AnalysisEngine(engine, [StragglersDetector(settle_s=0)]).cycle()
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT id, key, kind, severity, state, primary_node, suspects, evidence, summary"
                " FROM incidents WHERE detector = 'stragglers' AND evidence->>'job' = :job"
                " ORDER BY id"
            ),
            {"job": job},
        )
        return [dict(r._mapping) for r in rows]


async def slow_node_incident(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine, prefix: str
) -> tuple[str, list[str], dict[str, Any]]:
    """Rank 5 (the third node) 30 % slow in every one of 40 steps over 78 s, its GPU throttled."""
    cluster = Cluster(client, backend)
    job, nodes = await eight_rank_job(cluster, prefix)
    now = datetime.now(UTC)
    for node in nodes:
        slow = node == nodes[2]
        await cluster.post(node, gpus=[
            {"ts": (now - timedelta(seconds=s)).isoformat(), "gpu": g,
             "sm_clock_mhz": 1410.0 if slow else 1980.0,
             "throttle_reasons": THROTTLE_HW_SLOWDOWN if slow else 0}
            for s in range(0, 20, 2) for g in range(2)
        ])
    await post_steps(cluster, job, nodes[0], step_times(40, {5: set(range(40))}))
    [incident] = await straggler_incidents(engine, job)
    return job, nodes, incident


async def test_slow_rank_opens_one_incident_naming_its_node(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine
) -> None:
    job, nodes, incident = await slow_node_incident(client, backend, engine, "st")
    assert incident["key"] == f"stragglers:{job}:{nodes[2]}"
    assert (incident["kind"], incident["severity"], incident["state"]) == (
        "straggler", "warning", "open")
    assert incident["primary_node"] == nodes[2]
    assert [s["id"] for s in incident["suspects"]] == [nodes[2]]
    ev = incident["evidence"]
    assert ev["ranks"] == [5] and ev["node"] == nodes[2]
    assert 0.25 < ev["slowdown"] < 0.35
    assert ev["z"] > 3.5
    # The node's GPUs corroborate: HW slowdown and a clock below the other nodes'.
    assert any("hw_slowdown" in h for h in ev["hints"])
    assert any("SM clock 1410" in h for h in ev["hints"])
    assert "30%" in incident["summary"] and nodes[2] in incident["summary"]


async def test_one_slow_step_is_not_a_straggler(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine
) -> None:
    cluster = Cluster(client, backend)
    job, nodes = await eight_rank_job(cluster, "one")
    # A checkpoint or a GC pause: rank 5 is 30 % slow in step 30 only.
    await post_steps(cluster, job, nodes[0], step_times(40, {5: {30}}))
    assert await straggler_incidents(engine, job) == []


async def test_steps_route_validation_and_roles(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any
) -> None:
    cluster = Cluster(client, backend)
    job, nodes = await eight_rank_job(cluster, "val")
    outsider = f"out-{tag()}"
    await cluster.register(outsider)
    url = f"/api/v1/jobs/{job}/steps"
    now = datetime.now(UTC)

    def step(rank: int, n: int = 1, **extra: Any) -> dict[str, Any]:
        return {"rank": rank, "step": n, "duration_s": 1.0, "ts": now.isoformat(), **extra}

    async def stored() -> list[tuple[int, int, float]]:
        rows = await db.fetch("SELECT rank, step, duration_s FROM job_steps WHERE job = $1"
                              " ORDER BY rank, step", job)
        return [tuple(r) for r in rows]

    # Rank 9 is not in the rank map: the field is named, and nothing of the batch is kept.
    r = await client.post(url, headers=cluster.admin, json={"steps": [step(0), step(9)]})
    assert r.status_code == 422, r.text
    [err] = r.json()["detail"]
    assert err["loc"] == ["body", "steps", 1, "rank"] and err["field"] == "steps[1].rank"
    assert "rank 9" in err["msg"]
    assert await stored() == []

    bad_bodies = {
        "duration_s": {"steps": [step(0, duration_s=-1.0)]},
        "timezone": {"steps": [step(0, ts="2026-01-01T00:00:00")]},
        "given twice": {"steps": [step(0), step(0)]},
        "at least 1": {"steps": []},
        "at most 10000": {"steps": [step(0, n) for n in range(10_001)]},
        "extra": {"steps": [step(0, node="x")]},
    }
    for expected, body in bad_bodies.items():
        r = await client.post(url, headers=cluster.admin, json=body)
        assert r.status_code == 422 and expected in r.text, (expected, r.text)
    r = await client.post(url, headers=cluster.admin, json={
        "steps": [step(1, ts=(now + timedelta(days=1)).isoformat())]})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "time_window"
    assert r.json()["detail"][0]["field"] == "steps[0].ts"
    r = await client.post(f"/api/v1/jobs/nope-{tag()}/steps", headers=cluster.admin,
                          json={"steps": [step(0)]})
    assert r.status_code == 404

    # Who may post: a node the job runs on (for any of its ranks), isolate, admin.
    node_of = {n: {"Authorization": f"Bearer {cluster.tokens[n]}"} for n in cluster.tokens}
    assert (await client.post(url, json={"steps": [step(0)]})).status_code == 401
    r = await client.post(url, headers=await make_token(db, "read"), json={"steps": [step(0)]})
    assert r.status_code == 403
    r = await client.post(url, headers=node_of[outsider], json={"steps": [step(0)]})
    assert r.status_code == 403 and outsider in r.text
    assert await stored() == []
    r = await client.post(url, headers=node_of[nodes[1]], json={"steps": [step(2), step(7)]})
    assert r.status_code == 200, r.text
    r = await client.post(url, headers=await make_token(db, "isolate"),
                          json={"steps": [step(0)]})
    assert r.status_code == 200, r.text
    # A step posted again (an agent's retry, a job restarted from a checkpoint) replaces.
    r = await client.post(url, headers=cluster.admin,
                          json={"steps": [step(7, duration_s=2.5), step(7, 2)]})
    assert r.status_code == 200, r.text
    assert await stored() == [(0, 1, 1.0), (2, 1, 1.0), (7, 1, 2.5), (7, 2, 1.0)]
    # The job's own page, on the path the steps route extends, still answers.
    got = await client.get(f"/api/v1/jobs/{job}", headers=cluster.admin)
    assert got.status_code == 200 and len(got.json()["ranks"]) == RANKS


async def test_incident_bisect_runs_over_the_jobs_nodes(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine, db: Any
) -> None:
    job, nodes, incident = await slow_node_incident(client, backend, engine, "bi")
    url = f"/api/v1/incidents/{incident['id']}/bisect"
    isolate = await make_token(db, "isolate")

    r = await client.post(url, headers=await make_token(db, "read"), json={})
    assert r.status_code == 403
    # The command benchmark runs a program on every node: admin only, as on /bisections.
    r = await client.post(url, headers=isolate, json={
        "benchmark": "command", "spec": {"argv": ["true"], "pattern": "(1)"}})
    assert r.status_code == 403
    r = await client.post(url, headers=isolate, json={"threshold": 1.5})
    assert r.status_code == 422
    r = await client.post("/api/v1/incidents/999999999/bisect", headers=isolate, json={})
    assert r.status_code == 404

    r = await client.post(url, headers=isolate, json={"threshold": 0.15})
    assert r.status_code == 201, r.text
    bisection = r.json()
    assert sorted(bisection["nodes"]) == sorted(nodes)
    assert (bisection["benchmark"], bisection["threshold"], bisection["status"]) == (
        "gemm", 0.15, "running")
    # Its first round went out: one gemm task per node of the job.
    tasks = [t for g in bisection["rounds"][0]["groups"] for t in g["tasks"]]
    assert sorted(t["node"] for t in tasks) == sorted(nodes)
    got = (await client.get(f"/api/v1/bisections/{bisection['id']}", headers=isolate)).json()
    assert got["nodes"] == bisection["nodes"]
    # Those nodes are now busy: a second bisection over them is refused.
    r = await client.post(url, headers=isolate, json={})
    assert r.status_code == 409 and f"bisection {bisection['id']}" in r.text

    # An incident that names no job has no nodes to bisect.
    no_job = await db.fetchval(
        "INSERT INTO incidents (key, detector, kind, summary, evidence, first_seen)"
        " VALUES ($1, 'pfc', 'pfc-storm', '', '{}'::jsonb, now()) RETURNING id",
        f"pfc:nojob-{tag()}")
    r = await client.post(f"/api/v1/incidents/{no_job}/bisect", headers=isolate, json={})
    assert r.status_code == 422 and "names no job" in r.text
