"""Correlation, isolation policy, guardrails and actuators against real servers.

Each test cluster is a real ``meshwatch server`` on its own fresh database
(so node counts are exact), fed by real ingest batches: probe rows, Xid
events and NCCL watchdog timeouts as the agents send them. The analysis
engine, the correlator, the policy and the workers run inside the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx

from app.lab.processes import BackendProcess
from tests.conftest import asyncpg_dsn, with_database

T = TypeVar("T")

# Fast clocks for tests: the engine each 0.2 s, short windows and backoffs.
FAST_ENV = {
    "MESHWATCH_ENGINE_INTERVAL_S": "0.2",
    "MESHWATCH_WEBHOOK_INTERVAL_S": "0.1",
    "MESHWATCH_WEBHOOK_BACKOFF_S": "0.2",
    "MESHWATCH_WEBHOOK_TIMEOUT_S": "5",
    "MESHWATCH_ACTUATOR_BACKOFF_S": "0.2",
    "MESHWATCH_CORRELATE_WINDOW_S": "15",
}

XID79 = (
    "NVRM: Xid (PCI:0000:3b:00): 79, pid=1911, name=python, GPU has fallen off the bus."
)
# The line PyTorch's NCCL watchdog writes on every rank that waited (see
# tests/fixtures/nccl/ for captured ones).
NCCL_TIMEOUT = (
    "[Rank {rank}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4711,"
    " OpType=ALLREDUCE, NumelIn=262144, NumelOut=262144, Timeout(ms)=600000) ran for"
    " 600007 milliseconds before timing out."
)


async def wait_for(
    probe: Callable[[], Awaitable[T | None]], timeout: float = 30.0, what: str = "condition"
) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout``."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def now_iso() -> str:
    return datetime.now(UTC).isoformat()


@dataclass
class Cluster:
    """A backend on its own database, with registered nodes and tokens."""

    backend: BackendProcess
    url: str
    client: httpx.AsyncClient
    db: asyncpg.Connection
    tokens: dict[str, str] = field(default_factory=dict)
    seq: dict[str, int] = field(default_factory=dict)

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.backend.admin_token}"}

    def auth(self, token: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    async def register(self, nodes: list[str], rack: str = "tor-0") -> None:
        for i, node in enumerate(nodes):
            r = await self.client.post(
                "/api/v1/nodes/register",
                headers=self.auth(self.backend.bootstrap_token),
                json={"node": node, "hostname": f"{node}.example", "address":
                      f"198.18.{i // 200}.{i % 200 + 10}", "rack": rack, "gpu_count": 8},
            )
            assert r.status_code == 200, r.text
            self.tokens[node] = r.json()["token"]

    async def ingest(self, node: str, **rows: list[dict[str, Any]]) -> None:
        self.seq[node] = self.seq.get(node, 0) + 1
        batch = {"node": node, "seq": self.seq[node], "sent_at": now_iso(), **rows}
        r = await self.client.post("/api/v1/ingest", json=batch,
                                   headers=self.auth(self.tokens[node]))
        assert r.status_code == 200, r.text

    async def xid(self, node: str, xid: int = 79, severity: str = "critical") -> None:
        await self.ingest(node, events=[{
            "ts": now_iso(), "kind": "xid", "severity": severity, "message": XID79,
            "attrs": {"pci": "0000:3b:00", "xid": xid, "pid": 1911, "process": "python",
                      "action": "RESTART_BM"}}])

    async def api_token(self, role: str, name: str | None = None) -> str:
        r = await self.client.post("/api/v1/tokens", headers=self.admin,
                                   json={"name": name or f"{role}-client", "role": role})
        assert r.status_code == 201, r.text
        return r.json()["token"]

    async def node(self, node: str) -> dict[str, Any]:
        r = await self.client.get(f"/api/v1/nodes/{node}", headers=self.admin)
        assert r.status_code == 200, r.text
        return r.json()

    async def state(self, node: str) -> str:
        return await self.db.fetchval("SELECT state FROM nodes WHERE id = $1", node)

    async def correlated(self, state: str = "open") -> list[dict[str, Any]]:
        r = await self.client.get("/api/v1/incidents", headers=self.admin,
                                  params={"state": state, "limit": 1000})
        assert r.status_code == 200, r.text
        return [i for i in r.json() if i["detector"] == "correlator"]

    async def audit(self, **params: Any) -> list[dict[str, Any]]:
        r = await self.client.get("/api/v1/audit", headers=self.admin,
                                  params={"limit": 1000, **params})
        assert r.status_code == 200, r.text
        return r.json()

    def kill(self) -> None:
        """Crash the server (SIGKILL to its process group): no cleanup runs."""
        assert self.backend.proc is not None
        os.killpg(self.backend.proc.pid, signal.SIGKILL)
        self.backend.proc.wait()


@contextlib.asynccontextmanager
async def cluster(pg_url: str, tmp_path: Path, **env: str) -> AsyncIterator[Cluster]:
    """A fresh database and a real server on it; both gone afterwards."""
    name = f"mw_act_{secrets.token_hex(4)}"
    admin_conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    await admin_conn.execute(f'CREATE DATABASE "{name}"')
    url = with_database(pg_url, name)
    backend = BackendProcess(
        url, tmp_path / f"backend-{name}",
        bootstrap_token="boot-" + secrets.token_hex(4),
        admin_token="admin-" + secrets.token_hex(4),
        extra_env={**FAST_ENV, **env},
    )
    db = None
    try:
        await asyncio.to_thread(backend.start)
        db = await asyncpg.connect(asyncpg_dsn(url))
        async with httpx.AsyncClient(base_url=backend.url, timeout=20) as client:
            yield Cluster(backend, url, client, db)
    finally:
        await asyncio.to_thread(backend.stop)
        if db is not None:
            await db.close()
        await admin_conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin_conn.close()


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """A real HTTP server on 127.0.0.1 that records what it is sent.

    ``statuses``: the answers to give, in order (200 once they run out).
    ``hold``: when set, the next request is held without an answer until
    ``release`` is called (a sender that crashes meanwhile never hears back).
    """

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [])
        self.received: list[Received] = []
        self.hold = False
        self.held = threading.Event()
        self._release = threading.Event()
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, {k.lower(): v for k, v in self.headers.items()},
                                 body))
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                    hold, receiver.hold = receiver.hold, False
                if hold:
                    receiver.held.set()
                    receiver._release.wait(60)
                    status = 200
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                except OSError:
                    pass  # the sender is gone

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def release(self) -> None:
        self._release.set()

    def events(self, event: str | None = None) -> list[Received]:
        with self._lock:
            got = list(self.received)
        return [r for r in got if event is None or r.json().get("event") == event]

    def __enter__(self) -> Receiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self.server.shutdown()
        self.server.server_close()


class Feeder:
    """Sends, every half second, what live agents would: probe rows among the
    live nodes (all probes to ``dead`` nodes lost), and Xid 79 for ``xid_nodes``."""

    def __init__(self, c: Cluster, nodes: list[str]) -> None:
        self.c = c
        self.nodes = nodes
        self.dead: set[str] = set()
        self.xid_nodes: set[str] = set()
        self.probes = False
        self._task: asyncio.Task[None] | None = None

    async def round(self) -> None:
        ts = now_iso()
        sends = []
        if self.probes:
            for src in self.nodes:
                if src in self.dead:
                    continue
                rows = [
                    {"ts": ts, "peer": dst, "flow": flow, "sent": 1,
                     "received": 0 if dst in self.dead else 1,
                     **({} if dst in self.dead else
                        {"rtt_min_us": 30.0, "rtt_p50_us": 32.0, "rtt_max_us": 40.0})}
                    for dst in self.nodes if dst != src for flow in range(4)
                ]
                sends.append(self.c.ingest(src, probes=rows))
        for node in sorted(self.xid_nodes):
            sends.append(self.c.xid(node))
        await asyncio.gather(*sends)

    async def _run(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(0.5)

    def start(self) -> Feeder:
        self._task = asyncio.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


# -- tests --------------------------------------------------------------------


async def test_node_fault_is_one_incident_and_isolates_the_node(
    pg_url: str, tmp_path: Path
) -> None:
    """NCCL timeouts on 63 of 64 ranks, an Xid 79 and ping-mesh loss to one node:
    one correlated incident naming that node, which the default policy isolates;
    schedulers stop seeing it; it stays isolated after the fault until released."""
    nodes = [f"gpu-{i}" for i in range(8)]
    bad = "gpu-7"
    async with cluster(pg_url, tmp_path) as c:
        await c.register(nodes)
        feeder = Feeder(c, nodes)
        feeder.dead = {bad}
        feeder.probes = True
        feeder.start()
        try:
            # The job's ranks 0..63, 8 a node; rank 63 (on the bad node) hung and
            # never reports; every other rank's watchdog times out.
            for i, node in enumerate(nodes):
                await c.ingest(node, events=[
                    {"ts": now_iso(), "kind": "nccl_timeout", "severity": "error",
                     "job": "llm-pretrain", "rank": r, "message": NCCL_TIMEOUT.format(rank=r),
                     "attrs": {"seq": 4711, "op": "ALLREDUCE", "timeout_ms": 600000}}
                    for r in range(i * 8, i * 8 + 8) if r != 63
                ])
            await c.xid(bad)

            async def isolated() -> bool:
                return await c.state(bad) == "isolated"

            await wait_for(isolated, 30, f"{bad} isolated")

            async def merged() -> dict[str, Any] | None:
                incs = await c.correlated()
                mine = [i for i in incs if i["primary_node"] == bad]
                if mine and {"pingmesh", "gpu", "nccl"} <= set(mine[0]["evidence"]["sources"]):
                    return mine[0]
                return None

            inc = await wait_for(merged, 20, "pingmesh, gpu and nccl evidence on one incident")
            # Deduplicated: one open correlated incident for the node, none for the job.
            assert [i["primary_node"] for i in await c.correlated()] == [bad]
            assert inc["suspects"][0] == {"type": "node", "id": bad,
                                          "score": inc["suspects"][0]["score"]}
            assert inc["suspects"][0]["score"] >= 0.8
            assert inc["evidence"]["strength"] == "strong"
            assert inc["evidence"]["members"], "the pingmesh incident is listed as a member"
            # Ours (another detector may add its own view of the hang to the source).
            nccl = [e for e in inc["evidence"]["sources"]["nccl"] if "missing_ranks" in e][0]
            assert nccl["missing_ranks"] == [63] and nccl["ranks_reporting"] == 63
            assert inc["evidence"]["sources"]["gpu"][0]["xids"] == [79]

            # Schedulers: the node is no longer schedulable.
            reader = await c.api_token("read", "slurm-scheduler")
            r = await c.client.get("/api/v1/nodes", params={"schedulable": "true"},
                                   headers=c.auth(reader))
            assert r.status_code == 200
            assert sorted(n["id"] for n in r.json()) == nodes[:7]
            detail = await c.node(bad)
            assert detail["state"] == "isolated" and detail["schedulable"] is False
            assert detail["isolation"]["actor"] == "policy"
            assert detail["isolation"]["incident_id"] == inc["id"]
            assert inc["id"] in [i["id"] for i in detail["open_incidents"]]
            assert detail["last_seen"] is not None

            # The audit log names what, why, which incident, which rule, by whom.
            rows = await c.audit(node=bad, decision="isolated")
            assert len(rows) == 1
            assert rows[0]["incident_id"] == inc["id"] and rows[0]["actor"] == "policy"
            assert rows[0]["automatic"] and rows[0]["rule"].startswith(inc["kind"])
            r = await c.client.get(f"/api/v1/incidents/{inc['id']}/actions",
                                   headers=c.auth(reader))
            assert [a["actuator"] for a in r.json()["actuations"]] == ["db"]
        finally:
            await feeder.stop()


async def test_pingmesh_unreachable_node_isolated_until_released(
    pg_url: str, tmp_path: Path
) -> None:
    """Ping-mesh loss to one node alone (node-unreachable, score >= 0.8) isolates
    it under the default policy; when the fault ends the incident closes but the
    node stays out of scheduling until an operator releases it."""
    nodes = [f"h{i}" for i in range(6)]
    bad = "h3"
    async with cluster(pg_url, tmp_path) as c:
        await c.register(nodes)
        feeder = Feeder(c, nodes)
        feeder.dead = {bad}
        feeder.probes = True
        feeder.start()
        try:
            async def isolated() -> bool:
                return await c.state(bad) == "isolated"

            await wait_for(isolated, 30, f"{bad} isolated")
            inc = [i for i in await c.correlated() if i["primary_node"] == bad][0]
            assert inc["kind"] == "node-unreachable"
            assert set(inc["evidence"]["sources"]) == {"pingmesh"}
            r = await c.client.get("/api/v1/nodes", params={"schedulable": "true"},
                                   headers=c.admin)
            assert sorted(n["id"] for n in r.json()) == [n for n in nodes if n != bad]
            feeder.dead = set()  # the link is repaired: probes to it answer again
        finally:
            await feeder.stop()

        async def closed() -> list[dict[str, Any]]:
            return [i for i in await c.correlated("closed") if i["id"] == inc["id"]]

        await wait_for(closed, 45, "the correlated incident closed")
        assert await c.state(bad) == "isolated"
        operator = await c.api_token("isolate", "oncall-alice")
        r = await c.client.post(f"/api/v1/nodes/{bad}/release", headers=c.auth(operator),
                                json={"reason": "optic replaced, link clean"})
        assert r.status_code == 200, r.text
        assert r.json()["decision"] == "released"
        assert await c.state(bad) == "active"
        rel = await c.audit(node=bad, decision="released")
        assert rel[0]["actor"] == "oncall-alice"
        assert rel[0]["reason"] == "optic replaced, link clean"
        detail = await c.node(bad)
        assert detail["schedulable"] is True and detail["isolation"]["state"] == "released"


async def test_guardrails_fraction_rate_cooldown(pg_url: str, tmp_path: Path) -> None:
    """100 nodes, 5 %: the sixth isolation is refused and alerted instead; a
    released node is not isolated again within its cooldown; the hourly rate
    limit holds once the fraction allows more."""
    nodes = [f"n{i:03d}" for i in range(100)]
    with Receiver() as receiver:
        async with cluster(pg_url, tmp_path, MESHWATCH_MAX_ISOLATIONS_PER_HOUR="6") as c:
            await c.register(nodes)
            r = await c.client.post("/api/v1/webhooks", headers=c.admin, json={
                "name": "oncall", "url": receiver.url, "format": "native"})
            assert r.status_code == 201, r.text
            feeder = Feeder(c, nodes)
            faulty = nodes[:6]
            feeder.xid_nodes = set(faulty)
            feeder.start()
            try:
                async def six_decided() -> list[dict[str, Any]] | None:
                    rows = await c.audit(action="isolate")
                    decided = [a for a in rows if a["decision"] in ("isolated", "refused")]
                    return decided if len(decided) >= 6 else None

                decided = await wait_for(six_decided, 30, "six decisions")
                isolated = [a["node"] for a in decided if a["decision"] == "isolated"]
                refused = [a for a in decided if a["decision"] == "refused"]
                assert len(isolated) == 5 and len(refused) == 1
                assert "max isolated fraction" in refused[0]["reason"]
                assert refused[0]["reason"].startswith("max isolated fraction: 5 of 100")
                left = refused[0]["node"]
                assert await c.state(left) == "active"
                assert await c.db.fetchval(
                    "SELECT count(*) FROM nodes WHERE state = 'isolated'") == 5

                # Alerted instead: the webhook carries the refusal.
                def refusal_alerted() -> list[Received]:
                    return [e for e in receiver.events()
                            if (e.json().get("action") or {}).get("decision") == "refused"
                            and e.json()["node"] == left]

                async def alerted() -> list[Received]:
                    return refusal_alerted()

                got = await wait_for(alerted, 20, "the refusal alert")
                assert "max isolated fraction" in got[0].json()["action"]["reason"]

                # Release two: the refused node's open incident is isolated at its
                # next update (the sixth automatic isolation this hour).
                op = await c.api_token("isolate", "oncall-bob")
                for node in isolated[:2]:
                    r = await c.client.post(f"/api/v1/nodes/{node}/release",
                                            headers=c.auth(op), json={"reason": "checked"})
                    assert r.status_code == 200, r.text

                async def left_isolated() -> bool:
                    return await c.state(left) == "isolated"

                await wait_for(left_isolated, 20, "the refused node isolated once room frees")

                # The released nodes still fail, but are within their cooldown.
                async def cooled() -> list[dict[str, Any]]:
                    return [a for a in await c.audit(decision="refused")
                            if a["node"] in isolated[:2] and "cooldown" in a["reason"]]

                await wait_for(cooled, 20, "cooldown refusals")
                assert [await c.state(n) for n in isolated[:2]] == ["active", "active"]

                # A new fault: the fraction would allow it (4 of 5), the rate does not.
                feeder.xid_nodes.add(nodes[6])

                async def rate_refused() -> list[dict[str, Any]]:
                    return [a for a in await c.audit(node=nodes[6], decision="refused")
                            if "per hour" in a["reason"]]

                await wait_for(rate_refused, 20, "rate-limit refusal")
                assert await c.state(nodes[6]) == "active"
                assert await c.db.fetchval(
                    "SELECT count(*) FROM nodes WHERE state = 'isolated'") == 4
            finally:
                await feeder.stop()


async def test_weak_signal_alerts_and_dry_run_isolates_nothing(
    pg_url: str, tmp_path: Path
) -> None:
    """A single weak signal (an application Xid) never isolates; in dry-run a
    strong one is decided and audited but changes nothing."""
    nodes = [f"w{i}" for i in range(4)]
    async with cluster(pg_url, tmp_path, MESHWATCH_ISOLATION_DRY_RUN="true") as c:
        await c.register(nodes)
        await c.xid(nodes[0], xid=13, severity="warning")
        await c.xid(nodes[1], xid=79)

        async def decided() -> list[dict[str, Any]] | None:
            rows = await c.audit()
            return rows if {a["node"] for a in rows} >= {nodes[0], nodes[1]} else None

        rows = await wait_for(decided, 20, "both decisions")
        weak = [a for a in rows if a["node"] == nodes[0]][0]
        assert weak["decision"] == "alert" and "below" in weak["reason"]
        dry = [a for a in rows if a["node"] == nodes[1]][0]
        assert dry["decision"] == "dry-run" and dry["dry_run"] is True
        assert [await c.state(n) for n in nodes[:2]] == ["active", "active"]
        incs = {i["primary_node"]: i for i in await c.correlated()}
        assert incs[nodes[0]]["evidence"]["strength"] == "weak"
        # Manual dry-run: evaluated, audited, nothing changed.
        r = await c.client.post(f"/api/v1/nodes/{nodes[2]}/isolate", headers=c.admin,
                                json={"reason": "suspect DIMM", "dry_run": True})
        assert r.status_code == 200 and r.json()["decision"] == "dry-run"
        assert await c.state(nodes[2]) == "active"


FLAKY_SCONTROL = """
import json, pathlib, sys
log = pathlib.Path(sys.argv[1])
calls = log.read_text().splitlines() if log.exists() else []
log.write_text("\\n".join(calls + [json.dumps(sys.argv[2:])]) + "\\n")
if not calls:
    print("slurm_update error: Unable to contact slurm controller (connect failure)")
    sys.exit(1)
"""


async def test_actuators_retry_and_report_failures_on_the_incident(
    pg_url: str, tmp_path: Path
) -> None:
    """Slurm drain fails once, is retried and succeeds, with the reason as one
    argument; the Kubernetes actuator without its package fails with a clear
    error; both attempts are visible on the incident."""
    script = tmp_path / "scontrol.py"
    script.write_text(FLAKY_SCONTROL)
    calls = tmp_path / "calls.log"
    template = f"{sys.executable} {script} {calls} update nodename={{hostname}}" \
               " state=drain reason={reason}"
    nodes = [f"s{i}" for i in range(4)]
    async with cluster(
        pg_url, tmp_path,
        MESHWATCH_ACTUATORS="slurm,kubernetes",
        MESHWATCH_SLURM_ISOLATE_COMMAND=template,
        MESHWATCH_ACTUATOR_MAX_ATTEMPTS="3",
    ) as c:
        await c.register(nodes)
        await c.xid(nodes[0])

        async def settled() -> dict[str, Any] | None:
            incs = [i for i in await c.correlated() if i["primary_node"] == nodes[0]]
            actions = incs[0]["evidence"].get("actions", {}) if incs else {}
            states = {a["actuator"]: a for a in actions.values()}
            if states.get("slurm", {}).get("state") == "done" and \
                    states.get("kubernetes", {}).get("state") == "dead":
                return states
            return None

        states = await wait_for(settled, 30, "slurm done and kubernetes dead on the incident")
        assert states["db"]["state"] == "done"
        assert states["slurm"]["attempts"] == 2
        assert states["kubernetes"]["attempts"] == 3
        assert "kubernetes" in states["kubernetes"]["last_error"]
        assert "package" in states["kubernetes"]["last_error"]
        argv = [json.loads(line) for line in calls.read_text().splitlines()]
        assert len(argv) == 2 and argv[0] == argv[1]
        assert argv[0][:3] == ["update", f"nodename={nodes[0]}.example", "state=drain"]
        assert argv[0][3].startswith("reason=gpu-fault on node s0")
        assert len(argv[0]) == 4, "the reason stays one argument"
        detail = await c.node(nodes[0])
        by = {a["actuator"]: a for a in detail["actuations"]}
        assert by["slurm"]["state"] == "done" and by["kubernetes"]["state"] == "dead"
        assert by["kubernetes"]["last_error"] == states["kubernetes"]["last_error"]
