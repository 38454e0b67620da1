"""Where the database is: ``DATABASE_URL`` or an embedded PostgreSQL.

Unset, the server starts PostgreSQL from the ``pgserver`` package in a data
folder (Unix socket only, nothing listens on the network), so a new user has
nothing to install. ``EmbeddedPostgres.stop()`` shuts it down cleanly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

log = logging.getLogger(__name__)

DB_NAME = "meshwatch"


class EmbeddedPostgres:
    """A PostgreSQL server owned by this process, in ``data_dir/pg``."""

    def __init__(self, data_dir: Path) -> None:
        self.path = (data_dir / "pg").resolve()
        self._server: Any = None

    def start(self) -> str:
        import warnings

        import pgserver  # the server extra only

        self.path.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            # platformdirs warns that XDG_RUNTIME_DIR is unset (services, containers).
            warnings.simplefilter("ignore")
            # cleanup_mode="stop": pgserver counts the processes holding a handle and
            # stops the server when the last one lets go (at exit too), so a test
            # run and a server it starts can share one data folder.
            self._server = pgserver.get_server(self.path, cleanup_mode="stop")
        exists = self._server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DB_NAME}';")
        if "1 row" not in exists:
            self._server.psql(f"CREATE DATABASE {DB_NAME};")
        log.info("embedded PostgreSQL running in %s", self.path)
        return f"postgresql+asyncpg://postgres@/{DB_NAME}?host={self.path}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.cleanup()
            self._server = None


def normalise_url(url: str) -> str:
    """Accept postgres:// and postgresql:// URLs and use the asyncpg driver."""
    for prefix in (
        "postgres://",
        "postgresql://",
        "postgresql+psycopg2://",
        "postgresql+psycopg://",
    ):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    return url


def make_engine(url: str, pool_size: int = 10) -> AsyncEngine:
    return create_async_engine(
        normalise_url(url), pool_size=pool_size, max_overflow=10, pool_pre_ping=True
    )


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker:
    return async_sessionmaker(engine, expire_on_commit=False)
