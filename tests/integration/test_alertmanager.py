"""Alerts into a real Prometheus Alertmanager (Debian's prometheus-alertmanager),
started on 127.0.0.1 with a temporary config and storage, and read back
through its own API."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.lab.processes import free_port
from tests.integration.test_isolation import cluster, wait_for

CONFIG = """
route:
  receiver: blackhole
  group_wait: 1s
receivers:
  - name: blackhole
"""


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
    if binary is None:
        message = "needs prometheus-alertmanager (apt-get install prometheus-alertmanager)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    config = tmp_path / "alertmanager.yml"
    config.write_text(CONFIG)
    port = free_port()
    log = open(tmp_path / "alertmanager.log", "wb")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.path={tmp_path / 'am-data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    log.close()
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        with httpx.Client(timeout=1) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError((tmp_path / "alertmanager.log").read_text())
                try:
                    if client.get(f"{url}/-/ready").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("alertmanager did not become ready")
                time.sleep(0.05)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def test_alertmanager_receives_and_resolves_incident_alerts(
    alertmanager: str, pg_url: str, tmp_path: Path
) -> None:
    nodes = [f"am{i}" for i in range(4)]
    async with cluster(pg_url, tmp_path, MESHWATCH_CORRELATE_WINDOW_S="4") as c, \
            httpx.AsyncClient(base_url=alertmanager, timeout=5) as am:
        await c.register(nodes)
        r = await c.client.post("/api/v1/webhooks", headers=c.admin, json={
            "name": "alertmanager", "url": alertmanager, "format": "alertmanager"})
        assert r.status_code == 201, r.text
        hook = r.json()
        await c.xid("am2")

        async def firing() -> list[dict[str, Any]]:
            alerts = (await am.get("/api/v2/alerts")).json()
            return [a for a in alerts if a["labels"].get("node") == "am2"]

        (alert,) = await wait_for(firing, 30, "the alert in Alertmanager")
        assert alert["status"]["state"] == "active"
        assert alert["labels"]["alertname"] == "MeshwatchGpuFault"
        assert alert["labels"]["kind"] == "gpu-fault"
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["source"] == "meshwatch"
        incident = int(alert["labels"]["incident"])
        assert "gpu-fault on node am2" in alert["annotations"]["summary"]
        assert alert["annotations"]["action"].startswith("isolated")

        # The Xid ages out of the window, the incident closes, and the alert
        # is resolved in Alertmanager (resolved alerts leave its active list).
        async def resolved() -> bool:
            return not await firing()

        await wait_for(resolved, 45, "the alert resolved")
        r = await c.client.get(f"/api/v1/incidents/{incident}", headers=c.admin)
        assert r.json()["state"] == "closed"
        r = await c.client.get(f"/api/v1/webhooks/{hook['id']}/deliveries", headers=c.admin)
        events = [d["event"] for d in r.json()]
        assert events[0] == "incident.closed" and events[-1] == "incident.opened"
        assert all(d["state"] == "delivered" for d in r.json())
