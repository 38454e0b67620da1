"""``meshwatch``: the server-side command line.

meshwatch server   run the API, analysis engine and dashboard
meshwatch migrate  apply database migrations and partition maintenance
meshwatch bench    measure ingest and analysis throughput
meshwatch lab      network-namespace lab with real agents and injected faults
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from app.settings import Settings


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {}
    for key in ("host", "port", "data_dir", "database_url"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = value
    return Settings(**overrides)


def cmd_server(args: argparse.Namespace) -> int:
    import uvicorn

    from app.main import create_app

    settings = _settings(args).resolve_secrets()
    app = create_app(settings)
    where = (
        settings.database_url and "DATABASE_URL" or f"embedded PostgreSQL in {settings.data_dir}/pg"
    )
    api = f"http://{settings.host}:{settings.port}/api/v1"
    print(f"meshwatch API on {api}  (docs: /docs, db: {where})")
    if settings.env == "dev":
        print(f"tokens in {settings.secrets_file()} (admin_token reads the API)")
    sys.stdout.flush()
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
            access_log=False,
            # Agents hold long polls for tasks: cut them at shutdown rather than wait.
            timeout_graceful_shutdown=2,
        )
    )
    agent = LocalAgent(settings) if args.with_agent else None
    if agent:
        agent.start_when_ready()
    try:
        server.run()
    finally:
        if agent:
            agent.stop()
    return 0


class LocalAgent:
    """The quick start's agent for this machine, started once the API answers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = threading.Event()

    def start_when_ready(self) -> None:
        threading.Thread(target=self._run, name="local-agent", daemon=True).start()

    def _run(self) -> None:
        import httpx

        from app.lab.processes import agent_command

        base = f"http://{self.settings.host}:{self.settings.port}"
        while not self._stopping.is_set():
            try:
                if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            self._stopping.wait(0.2)
        if self._stopping.is_set():
            return
        argv = agent_command(
            base,
            socket.gethostname(),
            self.settings.bootstrap_token or "",
            self.settings.data_dir / "agent",
            extra=["--address", "127.0.0.1"],
        )
        self.proc = subprocess.Popen(argv)
        print(f"agent for this machine running as node {socket.gethostname()!r}", flush=True)

    def stop(self) -> None:
        self._stopping.set()
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def cmd_migrate(args: argparse.Namespace) -> int:
    from app.store.database import EmbeddedPostgres, make_engine
    from app.store.migrate import upgrade

    settings = _settings(args)

    async def run() -> None:
        embedded = None
        url = settings.database_url
        if not url:
            embedded = EmbeddedPostgres(settings.data_dir)
            url = embedded.start()
        engine = make_engine(url)
        try:
            await upgrade(engine, settings.retention_days)
        finally:
            await engine.dispose()
            if embedded:
                embedded.stop()

    asyncio.run(run())
    print(json.dumps({"migrated": True}) if args.json else "schema at head")
    return 0


def _add_db_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url", help="postgresql+asyncpg://... (default: $DATABASE_URL, else embedded)"
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        help="data folder for the embedded PostgreSQL and tokens (default .meshwatch)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshwatch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "server", help="run the API server (embedded PostgreSQL unless DATABASE_URL is set)"
    )
    _add_db_flags(p)
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--with-agent", action="store_true", help="also run an agent for this machine (quick start)"
    )
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("migrate", help="apply database migrations")
    _add_db_flags(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_migrate)

    from app import bench
    from app.lab import runner
    from app.sim import bisect as sim_bisect

    bench.add_parser(sub)
    runner.add_parser(sub)
    sim_bisect.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for noisy in ("alembic", "pgserver", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
