"""Who may call what: every route of the OpenAPI schema, called with a node
token, a read token, an isolate token, an admin token and no token."""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from app.lab.processes import BackendProcess

READ = {"read", "isolate", "admin"}
ISOLATE = {"isolate", "admin"}
ADMIN = {"admin"}
NODE = {"node"}

# (method, path) -> roles allowed. Routes not listed here (other resources)
# are still checked for refusing callers without a token.
EXPECTED: dict[tuple[str, str], set[str]] = {
    ("POST", "/api/v1/ingest"): NODE,
    ("GET", "/api/v1/pinglist/{node}"): NODE | READ,
    ("GET", "/api/v1/nodes"): READ,
    ("GET", "/api/v1/nodes/{node_id}"): READ,
    ("POST", "/api/v1/nodes/{node_id}/isolate"): ISOLATE,
    ("POST", "/api/v1/nodes/{node_id}/release"): ISOLATE,
    ("GET", "/api/v1/incidents"): READ,
    ("GET", "/api/v1/incidents/{incident_id}"): READ,
    ("GET", "/api/v1/incidents/{incident_id}/actions"): READ,
    ("GET", "/api/v1/audit"): READ,
    ("POST", "/api/v1/tokens"): ADMIN,
    ("GET", "/api/v1/tokens"): ADMIN,
    ("DELETE", "/api/v1/tokens/{token_id}"): ADMIN,
    ("POST", "/api/v1/webhooks"): ADMIN,
    ("GET", "/api/v1/webhooks"): ADMIN,
    ("GET", "/api/v1/webhooks/{webhook_id}"): ADMIN,
    ("DELETE", "/api/v1/webhooks/{webhook_id}"): ADMIN,
    ("GET", "/api/v1/webhooks/{webhook_id}/deliveries"): ADMIN,
    ("POST", "/api/v1/webhooks/{webhook_id}/deliveries/{delivery_id}/retry"): ADMIN,
}
PUBLIC = {("GET", "/healthz")}
BOOTSTRAP = {("POST", "/api/v1/nodes/register")}
ROLES = ("node", "read", "isolate", "admin", None)


async def make_token(client: httpx.AsyncClient, backend: BackendProcess, role: str) -> str:
    r = await client.post("/api/v1/tokens", json={"name": f"{role}-{secrets.token_hex(2)}",
                                                  "role": role},
                          headers={"Authorization": f"Bearer {backend.admin_token}"})
    assert r.status_code == 201, r.text
    return r.json()["token"]


@pytest.fixture
async def tokens(client: httpx.AsyncClient, backend: BackendProcess) -> dict[str, str]:
    node = f"role-node-{secrets.token_hex(3)}"
    r = await client.post("/api/v1/nodes/register",
                          headers={"Authorization": f"Bearer {backend.bootstrap_token}"},
                          json={"node": node, "hostname": node, "address": "198.18.0.50"})
    assert r.status_code == 200, r.text
    return {
        "node": r.json()["token"],
        "node_id": node,
        "read": await make_token(client, backend, "read"),
        "isolate": await make_token(client, backend, "isolate"),
        "admin": backend.admin_token,
    }


def concrete(path: str, spec: dict[str, Any], node: str) -> str:
    """Fill path parameters: the test node for node ids, an unknown id otherwise."""
    kinds = {p["name"]: p.get("schema", {}).get("type")
             for p in spec.get("parameters", []) if p.get("in") == "path"}

    def fill(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in ("node", "node_id"):
            return node
        return "999999999" if kinds.get(name) == "integer" else "no-such-thing"

    return re.sub(r"\{(\w+)\}", fill, path)


def valid_bodies(node: str) -> dict[tuple[str, str], Any]:
    """Routes that check the caller inside the handler, after the body is
    validated, get a valid body (a harmless one)."""
    return {
        ("POST", "/api/v1/ingest"): {"node": node, "seq": 1, "sent_at": datetime.now(
            UTC).isoformat()},
        ("POST", "/api/v1/nodes/register"): {"node": "role-intruder", "hostname": "x",
                                            "address": "198.18.0.99"},
    }


async def call(client: httpx.AsyncClient, method: str, url: str, token: str | None,
               body: Any = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # Otherwise an empty JSON body: dependencies authorise before the body is
    # validated, and an allowed caller gets 422 rather than a side effect.
    if body is None and method in ("POST", "PUT", "PATCH"):
        body = {}
    r = await client.request(method, url, headers=headers, json=body)
    return r.status_code


async def test_every_route_enforces_its_roles(client: httpx.AsyncClient,
                                              tokens: dict[str, str]) -> None:
    schema = (await client.get("/openapi.json")).json()
    routes = [(m.upper(), path, spec) for path, ops in schema["paths"].items()
              for m, spec in ops.items()]
    assert set(EXPECTED) <= {(m, p) for m, p, _ in routes}, "a documented route went missing"
    failures = []
    bodies = valid_bodies(tokens["node_id"])
    for method, path, spec in routes:
        url = concrete(path, spec, tokens["node_id"])
        if (method, path) in PUBLIC:
            continue
        for role in ROLES:
            token = tokens[role] if role else None
            status = await call(client, method, url, token, bodies.get((method, path)))
            if (method, path) in BOOTSTRAP:
                want = "401"  # only the bootstrap token enrols
                ok = status == 401
            elif (method, path) in EXPECTED:
                allowed = EXPECTED[(method, path)]
                if role in allowed:
                    want, ok = "allowed", status not in (401, 403)
                elif role is None:
                    want, ok = "401", status == 401
                else:
                    want, ok = "403", status == 403
            elif role is None:
                want, ok = "401", status == 401
            else:
                continue
            if not ok:
                failures.append(f"{method} {path} as {role}: {status}, expected {want}")
    assert not failures, "\n".join(failures)


async def test_tokens_shown_once_stored_hashed_and_revocable(
    client: httpx.AsyncClient, backend: BackendProcess, db: Any
) -> None:
    admin = {"Authorization": f"Bearer {backend.admin_token}"}
    r = await client.post("/api/v1/tokens", json={"name": "k8s-scheduler", "role": "isolate"},
                          headers=admin)
    assert r.status_code == 201
    created = r.json()
    token = created["token"]
    stored = await db.fetchval("SELECT token_hash FROM api_tokens WHERE id = $1", created["id"])
    assert stored == hashlib.sha256(token.encode()).hexdigest()
    assert await db.fetchval("SELECT count(*) FROM api_tokens WHERE token_hash = $1", token) == 0
    listed = (await client.get("/api/v1/tokens", headers=admin)).json()
    mine = [t for t in listed if t["id"] == created["id"]]
    assert mine == [{k: created[k] for k in ("id", "name", "role", "created_at")}]
    # Agents' role cannot be minted here.
    r = await client.post("/api/v1/tokens", json={"name": "x", "role": "node"}, headers=admin)
    assert r.status_code == 422
    auth = {"Authorization": f"Bearer {token}"}
    assert (await client.get("/api/v1/nodes", headers=auth)).status_code == 200
    r = await client.delete(f"/api/v1/tokens/{created['id']}", headers=admin)
    assert r.status_code == 204
    assert (await client.get("/api/v1/nodes", headers=auth)).status_code == 401
    r = await client.delete(f"/api/v1/tokens/{created['id']}", headers=admin)
    assert r.status_code == 404
