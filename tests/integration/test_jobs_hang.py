"""Jobs API and hang localisation end to end: real server, real ingest, real PostgreSQL.

Agents' batches go through ``POST /api/v1/ingest`` of the ``backend`` server;
the hang detector then runs against the same database, as the engine does.
"""

from __future__ import annotations

import asyncio
import secrets
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from agents.collectors.nccl_log import NcclLogCollector
from app.analysis.engine import AnalysisEngine
from app.analysis.hang import HangDetector
from app.api.deps import hash_token
from app.lab.processes import BackendProcess

NCCL_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "nccl"


def tag() -> str:
    return secrets.token_hex(3)


class Cluster:
    """Registered nodes that post batches as their agents would."""

    def __init__(self, client: httpx.AsyncClient, backend: BackendProcess) -> None:
        self.client = client
        self.backend = backend
        self.tokens: dict[str, str] = {}
        self.seq: dict[str, int] = {}

    async def register(self, *nodes: str) -> None:
        for node in nodes:
            r = await self.client.post(
                "/api/v1/nodes/register",
                headers={"Authorization": f"Bearer {self.backend.bootstrap_token}"},
                json={"node": node, "hostname": node, "address": "198.18.0.10", "rack": "tor-0"},
            )
            assert r.status_code == 200, r.text
            self.tokens[node] = r.json()["token"]
            self.seq[node] = 0

    async def post(self, node: str, **lists: list[dict[str, Any]]) -> None:
        self.seq[node] += 1
        now = datetime.now(UTC).isoformat()
        r = await self.client.post(
            "/api/v1/ingest",
            headers={"Authorization": f"Bearer {self.tokens[node]}"},
            json={"node": node, "seq": self.seq[node], "sent_at": now, **lists},
        )
        assert r.status_code == 200, r.text
        assert r.json()["duplicate"] is False

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.backend.admin_token}"}

    async def register_job(self, job: str, ranks: dict[int, tuple[str, int]]) -> None:
        r = await self.client.post(
            "/api/v1/jobs",
            headers=self.admin,
            json={"id": job, "name": "pretrain", "ranks": [
                {"rank": rank, "node": node, "gpu": gpu} for rank, (node, gpu) in ranks.items()
            ]},
        )
        assert r.status_code == 201, r.text


def timeout_event(job: str, rank: int, seq: int, op: str = "ALLREDUCE") -> dict[str, Any]:
    """The event NcclLogCollector makes of a PyTorch watchdog timeout line."""
    message = (
        f"[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq},"
        f" OpType={op}, Timeout(ms)=600000) ran for 600042 milliseconds before timing out."
    )
    return {
        "ts": datetime.now(UTC).isoformat(),
        "kind": "nccl_timeout",
        "severity": "error",
        "job": job,
        "rank": rank,
        "message": message,
        "attrs": {"reason": "watchdog_timeout", "seq": seq, "op": op, "timeout_ms": 600000,
                  "source": "pytorch.ProcessGroupNCCL"},
    }


async def hang_incidents(engine: AsyncEngine, job: str) -> list[dict[str, Any]]:
    # settle_s=0: these reports are all in; the settle wait has its own test.
    await AnalysisEngine(engine, [HangDetector(settle_s=0)]).cycle()
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT key, primary_node, suspects, evidence, summary, state FROM incidents"
                " WHERE detector = 'hang' AND evidence->>'job' = :job ORDER BY id"
            ),
            {"job": job},
        )
        return [dict(r._mapping) for r in rows]


async def test_job_api_round_trip(client: httpx.AsyncClient, backend: BackendProcess,
                                  db: Any) -> None:
    cluster = Cluster(client, backend)
    t = tag()
    job = f"train-{t}"
    body = {"id": job, "name": "llama-70b", "ranks": [
        {"rank": 0, "node": f"n0-{t}", "gpu": 0}, {"rank": 1, "node": f"n0-{t}", "gpu": 1},
        {"rank": 2, "node": f"n1-{t}", "gpu": 0}, {"rank": 3, "node": f"n1-{t}", "gpu": 1}]}
    r = await client.post("/api/v1/jobs", json=body, headers=cluster.admin)
    assert r.status_code == 201, r.text
    assert (r.json()["ranks"], r.json()["nodes"], r.json()["state"]) == (4, 2, "running")

    # A scheduler token (role isolate) may register; a read token may only look.
    tokens = {}
    for role in ("isolate", "read"):
        tokens[role] = secrets.token_urlsafe(16)
        await db.execute("INSERT INTO api_tokens (name, role, token_hash) VALUES ($1, $2, $3)",
                         f"{role}-{t}", role, hash_token(tokens[role]))
    body["ranks"][3]["node"] = f"n2-{t}"  # rank 3 moved
    r = await client.post("/api/v1/jobs", json=body,
                          headers={"Authorization": f"Bearer {tokens['isolate']}"})
    assert r.status_code == 200, r.text  # replaced, not created
    r = await client.post("/api/v1/jobs", json=body,
                          headers={"Authorization": f"Bearer {tokens['read']}"})
    assert r.status_code == 403
    assert (await client.post("/api/v1/jobs", json=body)).status_code == 401

    dup = {**body, "id": f"dup-{t}", "ranks": [body["ranks"][0], body["ranks"][0]]}
    r = await client.post("/api/v1/jobs", json=dup, headers=cluster.admin)
    assert r.status_code == 422 and "placed twice" in r.text

    # Progress comes from the job's events: rank 2 reports a timeout at seq 12.
    await cluster.register(f"n1-{t}")
    await cluster.post(f"n1-{t}", events=[timeout_event(job, 2, 12)])
    read = {"Authorization": f"Bearer {tokens['read']}"}
    got = (await client.get(f"/api/v1/jobs/{job}", headers=read)).json()
    assert got["name"] == "llama-70b" and got["registered_by"] == f"isolate-{t}"
    by_rank = {r["rank"]: r for r in got["ranks"]}
    assert [by_rank[i]["node"] for i in range(4)] == [f"n0-{t}", f"n0-{t}", f"n1-{t}", f"n2-{t}"]
    assert by_rank[2]["last_seq"] == 12 and by_rank[2]["last_event_kind"] == "nccl_timeout"
    assert by_rank[2]["last_event_at"] is not None
    assert by_rank[0]["last_seq"] is None and by_rank[0]["last_event_at"] is None
    listed = (await client.get("/api/v1/jobs", headers=read)).json()
    assert job in [j["id"] for j in listed]
    assert (await client.get(f"/api/v1/jobs/nope-{t}", headers=read)).status_code == 404


async def test_silent_node_from_real_log_lines(client: httpx.AsyncClient,
                                               backend: BackendProcess, engine: AsyncEngine,
                                               tmp_path: Path) -> None:
    """Real PyTorch timeout lines, read by the real collector on each node, name the silent node.

    The captured log holds ranks 2, 3, 4 and 6 timing out in broadcast 880; the
    job also has ranks 0 and 1, on a third node whose ranks said nothing.
    """
    t = tag()
    job = f"ds-{t}"
    n1, n2, n3 = f"gpu1-{t}", f"gpu2-{t}", f"gpu3-{t}"
    cluster = Cluster(client, backend)
    await cluster.register(n1, n2, n3)
    await cluster.register_job(job, {2: (n1, 0), 3: (n1, 1), 4: (n2, 0), 6: (n2, 1),
                                     0: (n3, 0), 1: (n3, 1)})
    lines = (NCCL_FIXTURES / "pytorch_118369_deepspeed_broadcast.log").read_text().splitlines()
    logs = {n1: ("[Rank 2]", "[Rank 3]"), n2: ("[Rank 4]", "[Rank 6]")}
    for node, ranks in logs.items():
        path = tmp_path / f"{node}.log"
        path.write_text("".join(line + "\n" for line in lines if any(r in line for r in ranks)))
        collector = NcclLogCollector([str(path)], job=job, from_start=True)
        samples = await collector.collect()
        await collector.close()
        assert len(samples.events) == 2
        await cluster.post(node, events=[e.model_dump(mode="json") for e in samples.events])

    [incident] = await hang_incidents(engine, job)
    assert incident["key"] == f"hang:{job}:880"
    assert incident["primary_node"] == n3
    assert incident["state"] == "open"
    ev = incident["evidence"]
    assert ev["waited_seq"] == 880 and ev["op"] == "BROADCAST"
    assert [r["rank"] for r in ev["silent_ranks"]] == [0, 1]
    assert {r["rank"] for r in ev["reports"]} == {2, 3, 4, 6}
    # The detector kept each rank's progress on the job.
    got = (await client.get(f"/api/v1/jobs/{job}", headers=cluster.admin)).json()
    assert {r["rank"]: r["last_seq"] for r in got["ranks"]} == {
        0: None, 1: None, 2: 880, 3: 880, 4: 880, 6: 880}
    assert [i["primary_node"] for i in got["open_incidents"]] == [n3]


async def test_rank_behind_by_one_collective(client: httpx.AsyncClient, backend: BackendProcess,
                                             engine: AsyncEngine) -> None:
    t = tag()
    job = f"behind-{t}"
    nodes = [f"h{i}-{t}" for i in range(4)]
    cluster = Cluster(client, backend)
    await cluster.register(*nodes)
    await cluster.register_job(job, {r: (nodes[r // 2], r % 2) for r in range(8)})
    # Rank 5 (node h2) is stuck in collective 880; the others wait in 881.
    await cluster.post(nodes[2], events=[timeout_event(job, 5, 880)])
    for i, node in enumerate(nodes):
        ranks = [r for r in (2 * i, 2 * i + 1) if r != 5]
        await cluster.post(node, events=[timeout_event(job, r, 881) for r in ranks])
    [incident] = await hang_incidents(engine, job)
    assert incident["primary_node"] == nodes[2]
    assert incident["key"] == f"hang:{job}:880"
    assert incident["evidence"]["behind_ranks"][0]["rank"] == 5
    assert incident["evidence"]["waited_seq"] == 881


async def test_same_seq_everywhere_ping_loss_names_the_node(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine
) -> None:
    t = tag()
    job = f"pingloss-{t}"
    nodes = [f"p{i}-{t}" for i in range(4)]
    cluster = Cluster(client, backend)
    await cluster.register(*nodes)
    await cluster.register_job(job, {r: (nodes[r // 2], r % 2) for r in range(8)})
    now = datetime.now(UTC)
    # Every node probes every other; p1 stopped answering.
    for src in nodes:
        probes = [
            {"ts": (now - timedelta(seconds=s)).isoformat(), "peer": dst, "flow": f,
             "sent": 1, "received": 0 if dst == nodes[1] else 1, "rtt_p50_us": 30.0}
            for dst in nodes if dst != src for f in range(4) for s in range(5)
        ]
        await cluster.post(src, probes=probes)
    for i, node in enumerate(nodes):
        await cluster.post(node, events=[timeout_event(job, r, 42) for r in (2 * i, 2 * i + 1)])
    [incident] = await hang_incidents(engine, job)
    assert incident["primary_node"] == nodes[1]
    assert [s["id"] for s in incident["suspects"]] == [nodes[1]]
    assert incident["evidence"]["nodes"][nodes[1]]["ping"] == {"sent": 60, "received": 0}


async def test_two_jobs_hang_at_once_on_different_nodes(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine
) -> None:
    t = tag()
    job_a, job_b = f"ja-{t}", f"jb-{t}"
    a = [f"a{i}-{t}" for i in range(2)]
    b = [f"b{i}-{t}" for i in range(2)]
    cluster = Cluster(client, backend)
    await cluster.register(*a, *b)
    await cluster.register_job(job_a, {0: (a[0], 0), 1: (a[0], 1), 2: (a[1], 0), 3: (a[1], 1)})
    await cluster.register_job(job_b, {0: (b[0], 0), 1: (b[0], 1), 2: (b[1], 0), 3: (b[1], 1)})
    # Job a: node a1 went silent, with an Xid; job b: rank 1 on b0 is behind, its GPU lost.
    await cluster.post(a[0], events=[timeout_event(job_a, 0, 300), timeout_event(job_a, 1, 300)])
    await cluster.post(a[1], events=[{
        "ts": datetime.now(UTC).isoformat(), "kind": "xid", "severity": "critical",
        "message": "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
        "attrs": {"xid": 79, "pci": "0000:3b:00"}}])
    await cluster.post(b[0], events=[
        timeout_event(job_b, 0, 77), timeout_event(job_b, 1, 76),
        {"ts": datetime.now(UTC).isoformat(), "kind": "gpu_lost", "severity": "critical",
         "message": "GPU 1 (00000000:19:00.0) is lost: NVML_ERROR_GPU_IS_LOST",
         "attrs": {"gpu": 1, "pci": "00000000:19:00.0"}}])
    await cluster.post(b[1], events=[timeout_event(job_b, 2, 77), timeout_event(job_b, 3, 77)])
    [inc_a] = await hang_incidents(engine, job_a)
    [inc_b] = await hang_incidents(engine, job_b)
    assert (inc_a["key"], inc_a["primary_node"]) == (f"hang:{job_a}:300", a[1])
    assert (inc_b["key"], inc_b["primary_node"]) == (f"hang:{job_b}:77", b[0])
    assert any("Xid 79" in r for r in inc_a["evidence"]["nodes"][a[1]]["reasons"])
    assert inc_b["evidence"]["nodes"][b[0]]["gpu_lost"][0]["gpu"] == 1


async def test_engine_woken_by_ingest_opens_the_incident(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine
) -> None:
    """The running engine (leader, listening for ingest's NOTIFY) opens the incident by itself."""
    t = tag()
    job = f"wake-{t}"
    nodes = [f"w{i}-{t}" for i in range(2)]
    cluster = Cluster(client, backend)
    await cluster.register(*nodes)
    await cluster.register_job(job, {0: (nodes[0], 0), 1: (nodes[1], 0)})
    analysis = AnalysisEngine(engine, [HangDetector()], interval_s=30.0)
    runner = asyncio.create_task(analysis.run())
    try:
        deadline = asyncio.get_running_loop().time() + 20
        while not (analysis.is_leader and analysis.cycles >= 1):
            assert asyncio.get_running_loop().time() < deadline, "engine never became leader"
            await asyncio.sleep(0.05)
        cycles = analysis.cycles
        # Its first cycle is done and the next is 30 s away: only ingest's wake-up makes it
        # look again before the deadline below.
        await cluster.post(nodes[0], events=[timeout_event(job, 0, 5)])
        found: list[dict[str, Any]] = []
        deadline = asyncio.get_running_loop().time() + 10
        while not found:
            assert asyncio.get_running_loop().time() < deadline, "no incident after ingest"
            await asyncio.sleep(0.05)
            if analysis.cycles > cycles:
                got = (await client.get(f"/api/v1/jobs/{job}", headers=cluster.admin)).json()
                found = got["open_incidents"]
        assert found[0]["primary_node"] == nodes[1]
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def test_reports_still_arriving_are_not_mistaken_for_silence(
    client: httpx.AsyncClient, backend: BackendProcess, engine: AsyncEngine
) -> None:
    """Right after the first timeouts land, the ranks whose reports are still on their way
    must not be blamed as silent: the detector waits for the second's reports to settle."""
    t = tag()
    job = f"settle-{t}"
    nodes = [f"s{i}-{t}" for i in range(4)]
    cluster = Cluster(client, backend)
    await cluster.register(*nodes)
    await cluster.register_job(job, {i: (n, 0) for i, n in enumerate(nodes)})
    await cluster.post(nodes[0], events=[timeout_event(job, 0, 77)])
    detector = HangDetector(settle_s=1.0)
    async with engine.begin() as conn:
        early = await detector.evaluate(conn, datetime.now(UTC))
    assert [r for r in early if r.evidence.get("job") == job] == []
    # The rest arrive; rank 3's node never reports: it, alone, is the suspect.
    await cluster.post(nodes[1], events=[timeout_event(job, 1, 77)])
    await cluster.post(nodes[2], events=[timeout_event(job, 2, 77)])
    async with engine.begin() as conn:
        reports = await detector.evaluate(conn, datetime.now(UTC) + timedelta(seconds=1.5))
    mine = [r for r in reports if r.evidence.get("job") == job]
    assert len(mine) == 1
    assert [s.id for s in mine[0].suspects if s.type == "node"] == [nodes[3]]
