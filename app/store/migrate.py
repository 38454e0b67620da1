"""Apply Alembic migrations and partition maintenance: ``meshwatch migrate``
and the server at start both come here."""

from __future__ import annotations

import asyncio
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.ext.asyncio import AsyncEngine

from app.store import partitions
from app.store.database import normalise_url

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["url"] = normalise_url(url)
    return cfg


async def upgrade(engine: AsyncEngine, retention_days: int) -> None:
    """Bring the schema to head, then make sure today's partitions exist."""
    url = engine.url.render_as_string(hide_password=False)
    # env.py runs its own event loop; keep it off ours.
    await asyncio.to_thread(command.upgrade, alembic_config(url), "heads")
    async with engine.begin() as conn:
        await partitions.maintain(conn, retention_days)
