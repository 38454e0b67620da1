"""The web dashboard in a real headless Chromium against a real server.

Nodes are enrolled and fed through the public API as agents do; incidents
are written into the incidents table as the analysis engine writes them
(the shared test server runs without the engine).
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import httpx
import pytest
from playwright.async_api import Dialog, Locator, Page, expect

from app.lab.processes import BackendProcess
from tests.browser.conftest import PageLog

T = TypeVar("T")
STALE = re.compile(r"\bstale\b")
ISOLATED = re.compile(r"\bisolated\b")


async def wait_until(probe: Callable[[], Awaitable[T | None]], what: str,
                     timeout: float = 15.0) -> T:
    """Poll ``probe`` until it returns something truthy; fail after ``timeout``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: Any = None
    while loop.time() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last: {last!r}")


def admin(backend: BackendProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {backend.admin_token}"}


async def make_token(client: httpx.AsyncClient, backend: BackendProcess,
                     role: str) -> tuple[str, str]:
    """A new API token of ``role``: (name, secret)."""
    name = f"dashboard-{role}-{secrets.token_hex(3)}"
    r = await client.post("/api/v1/tokens", json={"name": name, "role": role},
                          headers=admin(backend))
    assert r.status_code == 201, r.text
    return name, r.json()["token"]


async def enrol(client: httpx.AsyncClient, backend: BackendProcess, node: str, rack: str) -> str:
    r = await client.post(
        "/api/v1/nodes/register",
        headers={"Authorization": f"Bearer {backend.bootstrap_token}"},
        json={"node": node, "hostname": node, "address": "198.18.0.20", "rack": rack},
    )
    assert r.status_code == 200, r.text
    return r.json()["token"]


async def ingest_one_batch(client: httpx.AsyncClient, node: str, node_token: str) -> None:
    ts = datetime.now(UTC).isoformat()
    batch = {
        "node": node,
        "seq": 1,
        "sent_at": ts,
        "hosts": [{"ts": ts, "cpu_pct": 3.0, "load1": 0.2, "mem_total_bytes": 1 << 34,
                   "mem_available_bytes": 1 << 33}],
    }
    r = await client.post("/api/v1/ingest", json=batch,
                          headers={"Authorization": f"Bearer {node_token}"})
    assert r.status_code == 200, r.text


async def enter_token(page: Page, token: str) -> None:
    await page.get_by_label("API token").fill(token)
    await page.get_by_role("button", name="Save").click()


def node_row(page: Page, node: str) -> Locator:
    return page.locator(f'#nodes tbody tr[data-node="{node}"]')


async def test_page_loads_without_console_errors_or_outside_requests(
    page: Page, page_log: PageLog, backend: BackendProcess
) -> None:
    await page.goto(backend.url + "/")
    await expect(page.get_by_role("heading", level=1)).to_have_text("meshwatch")
    await expect(page.get_by_label("API token")).to_be_visible()
    await enter_token(page, backend.admin_token)
    await expect(page.get_by_role("heading", name="Nodes")).to_be_visible()
    await expect(page.locator("#updated")).not_to_have_text("never")
    assert page_log.console_errors == []
    assert page_log.page_errors == []
    outside = [u for u in page_log.requests
               if not u.startswith(backend.url + "/") and not u.startswith("data:")]
    assert outside == [], "the page fetched something from another origin"


async def test_admin_sees_fed_node_with_fresh_telemetry_and_counts(
    page: Page, page_log: PageLog, backend: BackendProcess, client: httpx.AsyncClient,
    db: asyncpg.Connection,
) -> None:
    fed, silent = f"dash-fed-{secrets.token_hex(3)}", f"dash-silent-{secrets.token_hex(3)}"
    quiet = f"dash-quiet-{secrets.token_hex(3)}"
    await page.goto(backend.url + "/")
    await expect(page.get_by_label("API token")).to_be_visible()
    await ingest_one_batch(client, fed, await enrol(client, backend, fed, "tor-7"))
    await enrol(client, backend, silent, "tor-7")
    # An agent whose last batch landed 30 s ago.
    await ingest_one_batch(client, quiet, await enrol(client, backend, quiet, "tor-7"))
    await db.execute("UPDATE nodes SET last_seen = now() - interval '30 seconds'"
                     " WHERE id = $1", quiet)
    await enter_token(page, backend.admin_token)

    row = node_row(page, fed)
    await expect(row).to_be_visible()
    await expect(row.get_by_role("rowheader")).to_have_text(fed)
    cells = row.locator("td")
    await expect(cells.nth(0)).to_have_text("tor-7")
    await expect(cells.nth(1)).to_have_text("active")
    await expect(cells.nth(2)).to_have_text("yes")
    age_cell = cells.nth(3)
    age = float(await age_cell.inner_text())
    assert 0 <= age < 5, f"telemetry age {age} s for a node fed just now"
    await expect(age_cell).not_to_have_class(STALE)
    # A node that never sent anything reads "never" and is marked stale, in red.
    silent_age = node_row(page, silent).locator("td").nth(3)
    await expect(silent_age).to_have_text("never")
    await expect(silent_age).to_have_class(STALE)
    await expect(silent_age).to_have_css("color", "rgb(179, 38, 30)")
    quiet_age = node_row(page, quiet).locator("td").nth(3)
    await expect(quiet_age).to_have_class(STALE)
    assert 30 <= float(await quiet_age.inner_text()) < 60

    nodes = (await client.get("/api/v1/nodes", headers=admin(backend))).json()
    incidents = (await client.get("/api/v1/incidents", params={"state": "open"},
                                  headers=admin(backend))).json()
    await expect(page.locator("#count-nodes")).to_have_text(str(len(nodes)))
    await expect(page.locator("#count-schedulable")).to_have_text(
        str(sum(n["schedulable"] for n in nodes)))
    await expect(page.locator("#count-isolated")).to_have_text(
        str(sum(n["state"] == "isolated" for n in nodes)))
    await expect(page.locator("#count-incidents")).to_have_text(str(len(incidents)))
    assert page_log.console_errors == []


@pytest.fixture
async def incidents(db: asyncpg.Connection) -> AsyncIterator[list[int]]:
    """Ids of incidents a test opened; closed again afterwards."""
    ids: list[int] = []
    yield ids
    if ids:
        await db.execute("UPDATE incidents SET state = 'closed', closed_at = now()"
                         " WHERE id = ANY($1::bigint[])", ids)


async def open_incident(db: asyncpg.Connection, summary: str, suspects: list[dict[str, Any]],
                        evidence: dict[str, Any], opened_at: datetime) -> int:
    """An open incident row, as the analysis engine writes one."""
    return await db.fetchval(
        "INSERT INTO incidents (key, detector, kind, severity, summary, primary_node, suspects,"
        " evidence, first_seen, opened_at, updated_at, last_seen)"
        " VALUES ($1, 'pingmesh', 'node-unreachable', 'critical', $2, $3, $4::jsonb,"
        " $5::jsonb, $6, $6, $6, $6) RETURNING id",
        f"pingmesh:test-{secrets.token_hex(4)}", summary, suspects[0]["id"],
        json.dumps(suspects), json.dumps(evidence), opened_at,
    )


async def test_open_incidents_newest_first_with_suspects_and_evidence(
    page: Page, page_log: PageLog, backend: BackendProcess, client: httpx.AsyncClient,
    db: asyncpg.Connection, incidents: list[int], tmp_path: Path,
) -> None:
    suspect = f"dash-bad-{secrets.token_hex(3)}"
    now = datetime.now(UTC)
    older = await open_incident(db, "older incident",
                                [{"type": "node", "id": "dash-old", "score": 0.5}],
                                {"probes": []}, now - timedelta(minutes=5))
    incidents.append(older)
    evidence = {"loss_pct": 100.0, "peers_losing": ["dash-p1", "dash-p2", "dash-p3"],
                "window_s": 10, "probes": [{"src": "dash-p1", "dst": suspect, "sent": 40,
                                            "received": 0}]}
    suspects = [
        {"type": "node", "id": suspect, "score": 0.93},
        {"type": "link", "id": f"tor-3/{suspect}", "score": 0.41},
        {"type": "switch", "id": "tor-3", "score": 0.12},
        {"type": "node", "id": "dash-p1", "score": 0.01},
    ]
    newer = await open_incident(db, f"{suspect} lost every probe from 3 peers", suspects,
                                evidence, now)
    incidents.append(newer)
    await enrol(client, backend, suspect, "tor-3")
    _, read_token = await make_token(client, backend, "read")

    await page.goto(backend.url + "/")
    await enter_token(page, read_token)
    item = page.locator(f'#incidents > li[data-id="{newer}"]')
    await expect(item).to_be_visible()
    await expect(item.get_by_role("heading", level=3)).to_have_text("critical node-unreachable")
    await expect(item.locator(".summary")).to_have_text(
        f"{suspect} lost every probe from 3 peers")
    shown = item.locator(".suspects > li")
    await expect(shown).to_have_count(3)  # the top three of four
    await expect(shown.first).to_have_text(f"node {suspect} 0.93")
    await expect(shown.nth(1)).to_have_text(f"link tor-3/{suspect} 0.41")
    opened = await item.locator("time").get_attribute("datetime")
    assert datetime.fromisoformat(opened or "") == now
    ids = await page.locator("#incidents > li").evaluate_all(
        "items => items.map(li => li.dataset.id)")
    assert ids.index(str(newer)) < ids.index(str(older)), "the newest incident is not first"

    pre = item.locator("pre.evidence")
    await expect(pre).to_be_hidden()
    await item.get_by_text("Evidence", exact=True).click()
    await expect(pre).to_be_visible()
    text = await pre.inner_text()
    assert json.loads(text) == evidence
    assert '\n  "loss_pct": 100' in text, "evidence is not pretty-printed"

    # The expanded evidence stays open across refreshes and follows updates.
    await db.execute("UPDATE incidents SET evidence = evidence || '{\"window_s\": 20}',"
                     " updated_at = now() WHERE id = $1", newer)
    await expect(pre).to_contain_text('"window_s": 20')
    await expect(pre).to_be_visible()

    # A read token gets no isolate buttons; the token survives a reload.
    await expect(node_row(page, suspect)).to_be_visible()
    await expect(page.get_by_role("columnheader", name="Actions")).to_be_hidden()
    node_buttons = page.get_by_role("button", name=re.compile("^(Isolate|Release) "))
    await expect(node_buttons).to_have_count(0)
    await page.reload()
    await expect(item).to_be_visible()
    await expect(page.get_by_label("API token")).to_be_hidden()
    await item.get_by_text("Evidence", exact=True).click()
    await page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
    assert page_log.console_errors == []


async def test_wrong_token_shows_the_error_line(
    page: Page, backend: BackendProcess, client: httpx.AsyncClient
) -> None:
    await page.goto(backend.url + "/")
    error = page.get_by_role("alert")
    await expect(error).to_have_attribute("aria-live", "assertive")
    await enter_token(page, "not-a-meshwatch-token")
    await expect(error).to_contain_text("401")
    await expect(error).to_contain_text("refused the token")
    await expect(page.get_by_label("API token")).to_be_visible()
    await expect(page.locator("#content")).to_be_hidden()

    # A node's own token is known to the server but may not read the cluster: 403.
    node = f"dash-agent-{secrets.token_hex(3)}"
    await enter_token(page, await enrol(client, backend, node, "tor-1"))
    await expect(error).to_contain_text("403")
    await expect(page.get_by_label("API token")).to_be_visible()

    # A good token clears the error line.
    await enter_token(page, backend.admin_token)
    await expect(node_row(page, node)).to_be_visible()
    await expect(error).to_have_text("")


async def test_isolate_and_release_from_the_dashboard(
    page: Page, page_log: PageLog, backend: BackendProcess, client: httpx.AsyncClient
) -> None:
    node = f"dash-iso-{secrets.token_hex(3)}"
    await ingest_one_batch(client, node, await enrol(client, backend, node, "tor-2"))
    token_name, token = await make_token(client, backend, "isolate")
    reasons: list[str] = []
    prompts: list[str] = []

    async def answer(dialog: Dialog) -> None:
        prompts.append(dialog.type)
        await dialog.accept(reasons.pop(0))

    page.on("dialog", answer)
    await page.goto(backend.url + "/")
    await enter_token(page, token)
    row = node_row(page, node)
    await expect(row.get_by_role("button", name=f"Isolate {node}")).to_be_visible()

    async def api_node() -> dict[str, Any]:
        r = await client.get(f"/api/v1/nodes/{node}", headers=admin(backend))
        assert r.status_code == 200, r.text
        return r.json()

    async def state_is(state: str) -> dict[str, Any] | None:
        detail = await api_node()
        if detail["state"] == state:
            return detail
        # A refusal (a guardrail, a role) shows on the page's error line.
        assert not await page.get_by_role("alert").inner_text(), "the page reported an error"
        return None

    reasons.append("flapping uplink seen on the switch")
    await row.get_by_role("button", name=f"Isolate {node}").click()
    isolated = await wait_until(lambda: state_is("isolated"), f"{node} isolated in the API")
    assert isolated["schedulable"] is False
    assert isolated["isolation"]["reason"] == "flapping uplink seen on the switch"
    assert isolated["isolation"]["actor"] == token_name
    await expect(row).to_have_class(ISOLATED)
    await expect(row.locator(".isolated-tag")).to_have_text("isolated")
    await expect(row.locator("td").nth(2)).to_have_text("no")

    reasons.append("uplink replaced")
    await row.get_by_role("button", name=f"Release {node}").click()
    await wait_until(lambda: state_is("active"), f"{node} released in the API")
    await expect(row.get_by_role("button", name=f"Isolate {node}")).to_be_visible()
    await expect(row).not_to_have_class(ISOLATED)
    assert prompts == ["prompt", "prompt"]
    assert page_log.console_errors == []


async def test_lost_connection_shows_and_clears_by_itself(
    page: Page, backend: BackendProcess
) -> None:
    await page.goto(backend.url + "/")
    await enter_token(page, backend.admin_token)
    error = page.get_by_role("alert")
    await expect(page.locator("#updated")).not_to_have_text("never")
    # The network drops the API calls (as during a server restart); polling goes on.
    await page.route("**/api/v1/**", lambda route: route.abort("connectionrefused"))
    await expect(error).to_contain_text("Cannot reach the server")
    await page.unroute("**/api/v1/**")
    await expect(error).to_have_text("")
    await expect(page.get_by_label("API token")).to_be_hidden()
