"""One leader among backend replicas, by PostgreSQL advisory lock.

``Leadership.run`` keeps trying to take a session-level advisory lock on a
dedicated connection. While it holds the lock it listens on a NOTIFY channel
and runs ``lead(conn)``; when the connection dies the lock dies with it and
another replica takes over. Used by the analysis engine and the bisection
driver, each with its own lock key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

STANDBY_RETRY_S = 2.0
RECONNECT_S = 1.0


class Leadership:
    def __init__(
        self,
        engine: AsyncEngine,
        lock_key: int,
        channel: str,
        on_notify: Callable[..., None],
        name: str,
    ) -> None:
        self.engine = engine
        self.lock_key = lock_key
        self.channel = channel
        self.on_notify = on_notify
        self.name = name
        self.is_leader = False

    async def run(self, lead: Callable[[Any], Awaitable[None]]) -> None:
        """Forever: stand by until the lock is ours, then ``lead(raw asyncpg connection)``."""
        while True:
            try:
                async with self.engine.connect() as lock_conn:
                    got = (
                        await lock_conn.execute(
                            text("SELECT pg_try_advisory_lock(:k)"), {"k": self.lock_key}
                        )
                    ).scalar()
                    await lock_conn.commit()
                    if not got:
                        self.is_leader = False
                        await asyncio.sleep(STANDBY_RETRY_S)
                        continue
                    raw: Any = (await lock_conn.get_raw_connection()).driver_connection
                    await raw.add_listener(self.channel, self.on_notify)
                    self.is_leader = True
                    log.info("%s is leader", self.name)
                    try:
                        await lead(raw)
                    finally:
                        self.is_leader = False
                        if not raw.is_closed():
                            await raw.remove_listener(self.channel, self.on_notify)
                            await lock_conn.execute(
                                text("SELECT pg_advisory_unlock(:k)"), {"k": self.lock_key}
                            )
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s lost its database connection; retrying", self.name)
                await asyncio.sleep(RECONNECT_S)
