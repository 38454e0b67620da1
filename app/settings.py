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
from typing import Any, Literal

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
    # -- actions: correlation, isolation policy, actuators, webhooks --------
    # Signals about one suspect within this many seconds become one incident.
    correlate_window_s: float = Field(default=120.0, gt=0)
    # Decide and audit, but change no node and call no actuator.
    isolation_dry_run: bool = False
    # Automatic isolation stops at this fraction of the nodes (never below
    # max_isolated_min_nodes, so a small cluster can still isolate one node).
    max_isolated_fraction: float = Field(default=0.05, ge=0, le=1)
    max_isolated_min_nodes: int = Field(default=1, ge=0)
    max_isolations_per_hour: int = Field(default=10, ge=0)
    # No automatic isolation of a node this soon after its last isolation or release.
    node_cooldown_s: float = Field(default=1800.0, ge=0)
    # JSON list of {"kind": glob, "action": "isolate"|"alert", "min_score": float};
    # unset: app.actions.policy.DEFAULT_RULES.
    isolation_rules: list[dict[str, Any]] | None = None
    # External actuators besides the database, comma separated: slurm, kubernetes.
    actuators: str = ""
    slurm_isolate_command: str = "scontrol update nodename={hostname} state=drain reason={reason}"
    slurm_release_command: str = "scontrol update nodename={hostname} state=resume"
    slurm_dry_run: bool = False
    kubernetes_dry_run: bool = False
    kubernetes_taint_key: str = "meshwatch.io/isolated"
    actuator_max_attempts: int = Field(default=5, ge=1)
    actuator_backoff_s: float = Field(default=2.0, gt=0)
    run_workers: bool = True  # webhook delivery and actuator loops
    webhook_interval_s: float = Field(default=1.0, gt=0)
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_backoff_s: float = Field(default=2.0, gt=0)
    webhook_backoff_max_s: float = Field(default=600.0, gt=0)
    webhook_timeout_s: float = Field(default=10.0, gt=0)
    webhook_concurrency: int = Field(default=4, ge=1, le=64)
    # Alertmanager forgets an alert not re-sent within its resolve_timeout.
    alertmanager_refresh_s: float = Field(default=60.0, gt=0)

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
