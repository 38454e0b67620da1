"""Shared fixtures: a real PostgreSQL for the whole run, and real servers.

``DATABASE_URL`` set: a fresh database is created on that server for this
run and dropped at the end. Unset: an embedded PostgreSQL (pgserver) is
started in a temporary folder. Either way the tests talk to real Postgres.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from app.lab.processes import BackendProcess
from app.store.database import make_engine, normalise_url


def asyncpg_dsn(url: str) -> str:
    """The plain libpq-style DSN asyncpg takes, from a SQLAlchemy URL."""
    u = make_url(normalise_url(url)).set(drivername="postgresql")
    return u.render_as_string(hide_password=False)


def with_database(url: str, name: str) -> str:
    return make_url(normalise_url(url)).set(database=name).render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    base = os.environ.get("DATABASE_URL")
    embedded = None
    tmp = None
    if not base:
        import pgserver

        tmp = tempfile.mkdtemp(prefix="mw-pg-")
        embedded = pgserver.get_server(Path(tmp), cleanup_mode="stop")
        base = f"postgresql+asyncpg://postgres@/postgres?host={tmp}"
    name = f"mw_test_{os.getpid()}_{secrets.token_hex(3)}"

    async def create() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(base))
        await conn.execute(f'CREATE DATABASE "{name}"')
        await conn.close()

    async def drop() -> None:
        conn = await asyncpg.connect(asyncpg_dsn(base))
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()

    asyncio.run(create())
    yield with_database(base, name)
    asyncio.run(drop())
    if embedded is not None:
        embedded.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def backend(pg_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackendProcess]:
    """One real ``meshwatch server`` process shared by the API tests."""
    server = BackendProcess(
        pg_url,
        tmp_path_factory.mktemp("backend"),
        bootstrap_token="test-bootstrap-" + secrets.token_hex(4),
        admin_token="test-admin-" + secrets.token_hex(4),
        extra_env={"MESHWATCH_RUN_ENGINE": "false"},
    )
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def client(backend: BackendProcess) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client on the shared backend."""
    async with httpx.AsyncClient(base_url=backend.url, timeout=20) as c:
        yield c


@pytest.fixture
async def engine(backend: BackendProcess, pg_url: str) -> AsyncIterator[AsyncEngine]:
    """A SQLAlchemy engine on the (migrated) test database, for running detectors."""
    eng = make_engine(pg_url, pool_size=2)
    yield eng
    await eng.dispose()


@pytest.fixture
def fresh_db_url(pg_url: str) -> Iterator[str]:
    """An empty database of its own on the test server (the lab needs a clean topology)."""
    name = f"mw_fresh_{secrets.token_hex(4)}"

    async def sql(statement: str) -> None:
        conn = await asyncpg.connect(asyncpg_dsn(pg_url))
        await conn.execute(statement)
        await conn.close()

    asyncio.run(sql(f'CREATE DATABASE "{name}"'))
    yield with_database(pg_url, name)
    asyncio.run(sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
async def db(pg_url: str):  # type: ignore[no-untyped-def]
    """A direct asyncpg connection to the test database, for counting rows."""
    conn = await asyncpg.connect(asyncpg_dsn(pg_url))
    yield conn
    await conn.close()
