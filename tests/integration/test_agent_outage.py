"""A real agent against a real server that goes away for a while: the agent
spools, the server comes back, and every batch is stored exactly once."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import asyncpg

from app.lab.processes import BackendProcess, agent_command
from tests.conftest import asyncpg_dsn

NODE = "outage-node"


async def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_backend_outage_loses_nothing_and_duplicates_nothing(
    fresh_db_url: str, tmp_path: Path
) -> None:
    backend = BackendProcess(
        fresh_db_url, tmp_path / "backend", extra_env={"MESHWATCH_RUN_ENGINE": "false"}
    )
    backend.start()
    state = tmp_path / "agent"
    agent = subprocess.Popen(
        agent_command(
            backend.url,
            NODE,
            backend.bootstrap_token,
            state,
            extra=[
                "--collectors",
                "host",
                "--batch-interval",
                "0.5",
                "--address",
                "127.0.0.1",
                "--log-level",
                "warning",
            ],
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    conn = await asyncpg.connect(asyncpg_dsn(fresh_db_url))
    try:

        async def ledger() -> int:
            return await conn.fetchval("SELECT count(*) FROM ingest_batches WHERE node = $1", NODE)

        await wait_for(lambda: _ge(ledger, 3), 30, "the first batches")
        outage_started = time.monotonic()
        backend.stop()
        # The agent keeps collecting while the backend is away: its spool grows.
        spool_dir = state / "spool"

        async def backlog() -> bool:
            files = [p for p in spool_dir.glob("*.json") if p.stem.isdigit()]
            return len(files) >= 8 and time.monotonic() - outage_started >= 5

        await wait_for(backlog, 30, "an outage of 5 s with batches piling up in the spool")
        backend.start()
        # Catch up, then stop the agent cleanly: its final batch is flushed too.
        before = await ledger()
        await wait_for(lambda: _ge(ledger, before + 8), 30, "the backlog to drain")
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=30)
        assert agent.returncode == 0, out.decode()[-2000:]
        next_seq = json.loads((spool_dir / "state.json").read_text())["next_seq"]
        seqs = [
            r[0]
            for r in await conn.fetch(
                "SELECT seq FROM ingest_batches WHERE node = $1 ORDER BY seq", NODE
            )
        ]
        # Every batch the agent ever made is stored, once.
        assert seqs == list(range(seqs[0], next_seq)), (seqs, next_seq)
        assert seqs[0] == 0
        stored_rows = sum(
            r[0] for r in await conn.fetch("SELECT rows FROM ingest_batches WHERE node = $1", NODE)
        )
        actual = sum(
            [
                await conn.fetchval("SELECT count(*) FROM host_samples WHERE node = $1", NODE),
                await conn.fetchval("SELECT count(*) FROM nic_counters WHERE node = $1", NODE),
                await conn.fetchval("SELECT count(*) FROM events WHERE node = $1", NODE),
            ]
        )
        assert stored_rows == actual > 0
        leftover = [p for p in spool_dir.glob("*.json") if p.stem.isdigit()]
        assert leftover == [], leftover
    finally:
        await conn.close()
        if agent.poll() is None:
            agent.kill()
        backend.stop()


async def _ge(fn: Any, n: int) -> bool:
    return (await fn()) >= n
