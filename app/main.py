"""The FastAPI application: routes, and the lifespan that owns the database,
migrations, partition maintenance and the analysis engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from app.actions import hooks as actions
from app.analysis.bisect_driver import run_bisections
from app.api import (
    bisections,
    dashboard,
    incidents,
    ingest,
    isolation,
    jobs,
    nodes,
    pinglist,
    tasks,
    tokens,
    webhooks,
)
from app.settings import Settings
from app.store import partitions
from app.store.database import EmbeddedPostgres, make_engine, make_sessionmaker
from app.store.migrate import upgrade

log = logging.getLogger(__name__)

PARTITION_MAINTENANCE_S = 3600


async def _maintain_partitions(app: FastAPI) -> None:
    while True:
        await asyncio.sleep(PARTITION_MAINTENANCE_S)
        try:
            async with app.state.engine.begin() as conn:
                result = await partitions.maintain(conn, app.state.settings.retention_days)
            if result["dropped"]:
                log.info("retention dropped %s", ", ".join(result["dropped"]))
        except Exception:  # a failed round is retried next hour; the API keeps serving
            log.exception("partition maintenance failed")


async def run_analysis_engine(app: FastAPI) -> None:
    from app.analysis.detectors import PfcDetector, PingmeshDetector, StragglersDetector
    from app.analysis.engine import AnalysisEngine
    from app.analysis.hang import HangDetector

    engine = AnalysisEngine(
        app.state.engine,
        [PingmeshDetector(), PfcDetector(), HangDetector(), StragglersDetector()],
        interval_s=app.state.settings.engine_interval_s,
    )
    actions.install(app, engine)  # the correlator (last detector) and the actions hook
    app.state.analysis = engine
    await engine.run()


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    embedded: EmbeddedPostgres | None = None
    url = settings.database_url
    if not url:
        embedded = EmbeddedPostgres(settings.data_dir)
        url = await asyncio.to_thread(embedded.start)
    engine = make_engine(url)
    tasks: list[asyncio.Task[None]] = []
    try:
        await upgrade(engine, settings.retention_days)
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        tasks.append(asyncio.create_task(_maintain_partitions(app)))
        for starter in app.state.background:
            tasks.append(asyncio.create_task(starter(app)))
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await engine.dispose()
        if embedded is not None:
            await asyncio.to_thread(embedded.stop)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = (settings or Settings()).resolve_secrets()
    app = FastAPI(
        title="meshwatch",
        version="0.1.0",
        description="Fault detection and network telemetry for GPU training clusters.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    # Long-running loops started with the app (the analysis engine, webhook
    # delivery); each is a coroutine function taking the app.
    app.state.background = []
    if settings.run_engine:
        app.state.background.append(run_analysis_engine)
    app.include_router(ingest.router)
    app.include_router(nodes.router)
    app.include_router(pinglist.router)
    app.include_router(incidents.router)
    app.include_router(jobs.router)
    app.include_router(isolation.router)
    app.include_router(tokens.router)
    app.include_router(webhooks.router)
    if settings.run_workers:
        app.state.background += [actions.run_webhook_worker, actions.run_actuator_worker]
    app.state.background += [tasks.run_task_listener, run_bisections]
    app.include_router(tasks.router)
    app.include_router(bisections.router)
    app.include_router(bisections.incident_router)
    app.include_router(dashboard.router)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    return app
