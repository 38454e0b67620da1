"""One ``Settings`` object for the backend, from environment variables.

Secrets: outside ``env=dev`` the server refuses to start without explicit
tokens. In dev (the quick start) it generates them once and keeps them in
the data folder, so a restart keeps the same tokens.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MESHWATCH_", extra="ignore")

    env: Literal["dev", "prod"] = "dev"
    database_url: str | None = Field(
        default=None, validation_alias=AliasChoices("DATABASE_URL", "MESHWATCH_DATABASE_URL")
    )
    data_dir: Path = Path(".meshwatch")
    host: str = "127.0.0.1"
    port: int = 8080
    bootstrap_token: str | None = None  # agents enrol with it
    admin_token: str | None = None
    retention_days: int = Field(default=7, ge=1, le=3650)
    max_body_bytes: int = 64 * 1024 * 1024  # after gunzip
    # Samples further in the future than this are a clock problem, not data.
    max_clock_skew_s: float = 300.0
    cross_tor_peers: int = Field(default=8, ge=0, le=1024)
    engine_interval_s: float = 1.0
    run_engine: bool = True

    def secrets_file(self) -> Path:
        return self.data_dir / "secrets.json"

    def resolve_secrets(self) -> Settings:
        """Fill in missing tokens: generated and persisted in dev, refused in prod."""
        if self.bootstrap_token and self.admin_token:
            return self
        if self.env != "dev":
            raise SystemExit(
                "MESHWATCH_BOOTSTRAP_TOKEN and MESHWATCH_ADMIN_TOKEN must be set outside env=dev"
            )
        path = self.secrets_file()
        stored: dict[str, str] = {}
        if path.exists():
            stored = json.loads(path.read_text())
        stored.setdefault("bootstrap_token", secrets.token_urlsafe(24))
        stored.setdefault("admin_token", secrets.token_urlsafe(24))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(stored, f, indent=2)
        tmp.replace(path)
        return self.model_copy(
            update={
                "bootstrap_token": self.bootstrap_token or stored["bootstrap_token"],
                "admin_token": self.admin_token or stored["admin_token"],
            }
        )
