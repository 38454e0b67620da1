"""Ingest against a real server process and a real PostgreSQL."""

from __future__ import annotations

import asyncio
import gzip
import json
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import httpx
import pytest

from app.lab.processes import BackendProcess
from tests.conftest import asyncpg_dsn, with_database

TABLES = {
    "probes": ("probe_stats", "src"),
    "hosts": ("host_samples", "node"),
    "gpus": ("gpu_samples", "node"),
    "nics": ("nic_counters", "node"),
    "events": ("events", "node"),
}


def now() -> str:
    return datetime.now(UTC).isoformat()


def full_batch(node: str, seq: int) -> dict[str, Any]:
    ts = now()
    return {
        "node": node,
        "seq": seq,
        "sent_at": ts,
        "probes": [
            {
                "ts": ts,
                "peer": "peer-1",
                "flow": f,
                "sent": 1,
                "received": 1,
                "rtt_min_us": 30.0,
                "rtt_p50_us": 31.5,
                "rtt_max_us": 40.0,
            }
            for f in range(4)
        ],
        "hosts": [
            {
                "ts": ts,
                "cpu_pct": 12.5,
                "load1": 0.7,
                "mem_total_bytes": 1 << 34,
                "mem_available_bytes": 1 << 33,
            }
        ],
        "gpus": [
            {"ts": ts, "gpu": g, "util_pct": 99.0, "temp_c": 61.0, "throttle_reasons": 0}
            for g in range(2)
        ],
        "nics": [
            {"ts": ts, "iface": "eth0", "counter": "tx_prio3_pause", "value": 10.0, "rate": None}
        ],
        "events": [
            {
                "ts": ts,
                "kind": "xid",
                "severity": "critical",
                "message": "NVRM: Xid 79",
                "attrs": {"xid": 79, "pci": "0000:3b:00"},
            }
        ],
    }


async def register(
    client: httpx.AsyncClient, backend: BackendProcess, node: str, **extra: Any
) -> str:
    r = await client.post(
        "/api/v1/nodes/register",
        headers={"Authorization": f"Bearer {backend.bootstrap_token}"},
        json={"node": node, "hostname": node, "address": "198.18.0.10", "rack": "tor-0", **extra},
    )
    assert r.status_code == 200, r.text
    return r.json()["token"]


async def counts(db: Any, node: str) -> dict[str, int]:
    out = {}
    for key, (table, col) in TABLES.items():
        out[key] = await db.fetchval(f"SELECT count(*) FROM {table} WHERE {col} = $1", node)
    out["ledger"] = await db.fetchval("SELECT count(*) FROM ingest_batches WHERE node = $1", node)
    return out


@pytest.fixture
def node() -> str:
    return f"node-{secrets.token_hex(4)}"


async def test_migrations_from_empty(pg_url: str, db: Any, tmp_path: Any) -> None:
    """A brand-new database migrates to head, twice in a row without error."""
    name = f"mw_empty_{secrets.token_hex(3)}"
    await db.execute(f'CREATE DATABASE "{name}"')
    try:
        url = with_database(pg_url, name)
        from app.cli import main

        assert await asyncio.to_thread(main, ["migrate", "--database-url", url]) == 0
        assert await asyncio.to_thread(main, ["migrate", "--database-url", url]) == 0
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            tables = {
                r[0]
                for r in await conn.fetch(
                    "SELECT tablename FROM pg_tables WHERE schemaname = 'public'"
                )
            }
            parts = await conn.fetchval(
                "SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent "
                "WHERE p.relname = 'probe_stats'"
            )
            version = await conn.fetchval("SELECT version_num FROM alembic_version")
        finally:
            await conn.close()
        assert {"nodes", "api_tokens", "ingest_batches", "alembic_version"} <= tables
        today = datetime.now(UTC).strftime("%Y%m%d")
        assert f"probe_stats_p{today}" in tables
        assert parts >= 7 + 3  # retention window plus today and two days ahead
        assert version is not None
    finally:
        await db.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_round_trip_stores_every_row(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str
) -> None:
    token = await register(client, backend, node)
    r = await client.post(
        "/api/v1/ingest", json=full_batch(node, 1), headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 200, r.text
    assert r.json() == {"node": node, "seq": 1, "duplicate": False, "rows": 9}
    assert await counts(db, node) == {
        "probes": 4,
        "hosts": 1,
        "gpus": 2,
        "nics": 1,
        "events": 1,
        "ledger": 1,
    }
    row = await db.fetchrow("SELECT * FROM probe_stats WHERE src = $1 AND flow = 2", node)
    assert row["dst"] == "peer-1" and row["rtt_p50_us"] == 31.5
    ev = await db.fetchrow("SELECT * FROM events WHERE node = $1", node)
    assert json.loads(ev["attrs"]) == {"xid": 79, "pci": "0000:3b:00"}
    assert ev["severity"] == "critical"
    nodes = (
        await client.get(
            "/api/v1/nodes", headers={"Authorization": f"Bearer {backend.admin_token}"}
        )
    ).json()
    mine = [n for n in nodes if n["id"] == node][0]
    assert mine["telemetry_age_s"] is not None and mine["telemetry_age_s"] < 5


async def test_gzip_body_accepted(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str
) -> None:
    token = await register(client, backend, node)
    body = gzip.compress(json.dumps(full_batch(node, 7)).encode())
    r = await client.post(
        "/api/v1/ingest",
        content=body,
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Encoding": "gzip",
            "Content-Type": "application/json",
        },
    )
    assert r.status_code == 200, r.text
    assert (await counts(db, node))["probes"] == 4
    r = await client.post(
        "/api/v1/ingest",
        content=b"\x1f\x8bnot gzip at all",
        headers={"Authorization": f"Bearer {token}", "Content-Encoding": "gzip"},
    )
    assert r.status_code == 400


async def test_retry_is_idempotent_even_concurrently(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str
) -> None:
    token = await register(client, backend, node)
    headers = {"Authorization": f"Bearer {token}"}
    batch = full_batch(node, 42)
    first = await client.post("/api/v1/ingest", json=batch, headers=headers)
    again = await client.post("/api/v1/ingest", json=batch, headers=headers)
    assert first.json()["duplicate"] is False
    assert again.status_code == 200 and again.json()["duplicate"] is True
    # Five copies of a new batch at once: exactly one is stored.
    batch2 = full_batch(node, 43)
    replies = await asyncio.gather(
        *(client.post("/api/v1/ingest", json=batch2, headers=headers) for _ in range(5))
    )
    assert all(r.status_code == 200 for r in replies)
    assert sorted(r.json()["duplicate"] for r in replies) == [False, True, True, True, True]
    assert await counts(db, node) == {
        "probes": 8,
        "hosts": 2,
        "gpus": 4,
        "nics": 2,
        "events": 2,
        "ledger": 2,
    }


def _mutate(batch: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    target: Any = batch
    parts = path.split(".")
    for p in parts[:-1]:
        target = target[int(p)] if p.isdigit() else target[p]
    last = parts[-1]
    if value is KeyError:
        del target[last]
    else:
        target[int(last) if last.isdigit() else last] = value
    return batch


MALFORMED = [
    ("probes.2.flow", "three", "probes[2].flow"),
    ("probes.0.sent", KeyError, "probes[0].sent"),
    ("probes.1.rtt_p50_us", 1e15, "probes[1].rtt_p50_us"),
    ("probes.1.received", 10**12, "probes[1].received"),
    ("gpus.0.temp_c", "hot", "gpus[0].temp_c"),
    ("nics.0.value", -5, "nics[0].value"),
    ("events.0.kind", "made_up", "events[0].kind"),
    ("events.0.message", "x" * 100_000, "events[0].message"),
    ("events.0.message", "nul\x00byte", "events[0].message"),
    ("hosts.0.ts", "2026-01-01T00:00:00", "hosts[0].ts"),  # no time zone
    ("probes.0.peer", "bad peer name", "probes[0].peer"),
    ("seq", -1, "seq"),
    ("node", KeyError, "node"),
    ("surprise", 1, "surprise"),
]


@pytest.mark.parametrize(("path", "value", "field"), MALFORMED)
async def test_malformed_batch_rejected_whole(
    client: httpx.AsyncClient,
    backend: BackendProcess,
    db: Any,
    node: str,
    path: str,
    value: Any,
    field: str,
) -> None:
    token = await register(client, backend, node)
    batch = _mutate(full_batch(node, 5), path, value)
    r = await client.post(
        "/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 422, r.text
    assert field in [d["field"] for d in r.json()["detail"]], r.text
    assert await counts(db, node) == dict.fromkeys(
        ["probes", "hosts", "gpus", "nics", "events", "ledger"], 0
    )


@pytest.mark.parametrize("delta", [timedelta(days=30), timedelta(hours=-2)])
async def test_timestamps_outside_window_rejected(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str, delta: timedelta
) -> None:
    token = await register(client, backend, node)
    batch = full_batch(node, 9)
    batch["probes"][3]["ts"] = (datetime.now(UTC) - delta).isoformat()
    r = await client.post(
        "/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 422
    assert r.json()["detail"][0]["field"] == "probes[3].ts"
    assert (await counts(db, node))["ledger"] == 0


async def test_too_many_rows_rejected(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str
) -> None:
    token = await register(client, backend, node)
    batch = full_batch(node, 1)
    batch["events"] = batch["events"] * 10_001
    r = await client.post(
        "/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 422 and r.json()["detail"][0]["field"] == "events"
    assert (await counts(db, node))["ledger"] == 0


async def test_auth_rejections(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str
) -> None:
    token = await register(client, backend, node)
    other = await register(client, backend, node + "-b")
    batch = full_batch(node, 1)
    assert (await client.post("/api/v1/ingest", json=batch)).status_code == 401
    r = await client.post("/api/v1/ingest", json=batch, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    # Another node's token may not write this node's telemetry.
    r = await client.post(
        "/api/v1/ingest", json=batch, headers={"Authorization": f"Bearer {other}"}
    )
    assert r.status_code == 403
    # An unknown node id with a valid token of a different node: 403 too.
    r = await client.post(
        "/api/v1/ingest",
        json=full_batch("never-registered", 1),
        headers={"Authorization": f"Bearer {token}"},
    )
    assert r.status_code == 403
    r = await client.post(
        "/api/v1/nodes/register",
        headers={"Authorization": "Bearer wrong"},
        json={"node": node, "hostname": node, "address": "198.18.0.1"},
    )
    assert r.status_code == 401
    # A node token cannot read the node list, nor an anonymous caller.
    assert (
        await client.get("/api/v1/nodes", headers={"Authorization": f"Bearer {token}"})
    ).status_code == 403
    assert (await client.get("/api/v1/nodes")).status_code == 401
    assert await counts(db, node) == dict.fromkeys(
        ["probes", "hosts", "gpus", "nics", "events", "ledger"], 0
    )


async def test_reregistering_keeps_identity(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any, node: str
) -> None:
    old = await register(client, backend, node)
    r = await client.post(
        "/api/v1/ingest", json=full_batch(node, 1), headers={"Authorization": f"Bearer {old}"}
    )
    assert r.status_code == 200
    before = await db.fetchrow("SELECT registered_at FROM nodes WHERE id = $1", node)
    new = await register(client, backend, node, rack="tor-9")
    assert new != old
    after = await db.fetchrow("SELECT registered_at, rack FROM nodes WHERE id = $1", node)
    assert after["registered_at"] == before["registered_at"] and after["rack"] == "tor-9"
    assert await db.fetchval("SELECT count(*) FROM nodes WHERE id = $1", node) == 1
    # The old token is dead, the new one continues the same history.
    r = await client.post(
        "/api/v1/ingest", json=full_batch(node, 2), headers={"Authorization": f"Bearer {old}"}
    )
    assert r.status_code == 401
    r = await client.post(
        "/api/v1/ingest", json=full_batch(node, 2), headers={"Authorization": f"Bearer {new}"}
    )
    assert r.status_code == 200
    assert (await counts(db, node))["ledger"] == 2
