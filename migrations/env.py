"""Alembic environment: async engine, one advisory lock so that several
backend replicas starting at once apply each migration exactly once."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from app.store.models import Base

MIGRATION_LOCK = 0x6D657368  # "mesh"

config = context.config
target_metadata = Base.metadata


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=connection, target_metadata=target_metadata)
    with context.begin_transaction():
        context.run_migrations()


async def _main() -> None:
    engine = create_async_engine(config.attributes["url"])
    async with engine.connect() as conn:
        await conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": MIGRATION_LOCK})
        await conn.commit()
        try:
            await conn.run_sync(_run)
            await conn.commit()
        finally:
            await conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": MIGRATION_LOCK})
            await conn.commit()
    await engine.dispose()


asyncio.run(_main())
