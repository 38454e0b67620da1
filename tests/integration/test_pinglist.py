"""Pinglist served from the registered topology, with ETag revalidation."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.lab.processes import BackendProcess


@pytest.fixture
def backend(fresh_db_url: str, tmp_path: Path) -> Iterator[BackendProcess]:
    """A server of its own: the cross-ToR sample depends on every rack registered."""
    server = BackendProcess(
        fresh_db_url, tmp_path / "backend", extra_env={"MESHWATCH_RUN_ENGINE": "false"}
    )
    server.start()
    yield server
    server.stop()


async def test_pinglist_follows_membership(backend: BackendProcess) -> None:
    run = secrets.token_hex(3)
    racks = [f"pl{run}-tor-0", f"pl{run}-tor-1"]
    names = [f"pl{run}-n{i}" for i in range(6)]
    tokens = {}
    async with httpx.AsyncClient(base_url=backend.url, timeout=20) as c:
        boot = {"Authorization": f"Bearer {backend.bootstrap_token}"}
        for i, n in enumerate(names):
            r = await c.post(
                "/api/v1/nodes/register",
                headers=boot,
                json={
                    "node": n,
                    "hostname": n,
                    "address": f"198.18.7.{i + 1}",
                    "probe_port": 7447,
                    "rack": racks[i // 3],
                },
            )
            tokens[n] = r.json()["token"]
        auth = {"Authorization": f"Bearer {tokens[names[0]]}"}
        r = await c.get(f"/api/v1/pinglist/{names[0]}", headers=auth)
        assert r.status_code == 200
        peers = {p["node"]: p for p in r.json()["peers"]}
        # Full mesh inside the rack, and the other rack is covered.
        assert {names[1], names[2]} <= set(peers)
        assert names[0] not in peers
        assert any(p in peers for p in names[3:])
        assert peers[names[1]]["address"] == "198.18.7.2"
        etag = r.headers["etag"]
        r = await c.get(f"/api/v1/pinglist/{names[0]}", headers={**auth, "If-None-Match": etag})
        assert r.status_code == 304
        # A new node in the same rack changes the list and its tag.
        new = f"pl{run}-n9"
        await c.post(
            "/api/v1/nodes/register",
            headers=boot,
            json={"node": new, "hostname": new, "address": "198.18.7.99", "rack": racks[0]},
        )
        r = await c.get(f"/api/v1/pinglist/{names[0]}", headers={**auth, "If-None-Match": etag})
        assert r.status_code == 200 and r.headers["etag"] != etag
        assert new in {p["node"] for p in r.json()["peers"]}
        # Agents read only their own pinglist.
        r = await c.get(f"/api/v1/pinglist/{names[1]}", headers=auth)
        assert r.status_code == 403
        r = await c.get(
            "/api/v1/pinglist/nobody", headers={"Authorization": f"Bearer {backend.admin_token}"}
        )
        assert r.status_code == 404
