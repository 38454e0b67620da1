"""Backend and agent processes for the lab and the tests: started as real
``meshwatch`` / ``meshwatch-agent`` commands, stopped with SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackendProcess:
    """``meshwatch server`` in a child process with explicit tokens."""

    def __init__(
        self,
        database_url: str | None,
        data_dir: Path,
        host: str = "127.0.0.1",
        port: int | None = None,
        bootstrap_token: str = "lab-bootstrap",
        admin_token: str = "lab-admin",
        extra_env: dict[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.database_url = database_url
        self.data_dir = data_dir
        self.bootstrap_token = bootstrap_token
        self.admin_token = admin_token
        self.extra_env = extra_env or {}
        self.log_path = log_path or data_dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackendProcess:
        env = {
            **os.environ,
            "MESHWATCH_BOOTSTRAP_TOKEN": self.bootstrap_token,
            "MESHWATCH_ADMIN_TOKEN": self.admin_token,
            **self.extra_env,
        }
        env.pop("DATABASE_URL", None)
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app.cli",
                "server",
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--data-dir",
                str(self.data_dir),
                "--log-level",
                "warning",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; see {self.log_path}:\n"
                    + self.log_path.read_text()[-3000:]
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> BackendProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def agent_command(
    server: str, node: str, bootstrap_token: str, state_dir: Path, extra: Sequence[str] = ()
) -> list[str]:
    """The argv of a real agent; the lab prefixes it with ``ip netns exec``."""
    return [
        sys.executable,
        "-m",
        "agents.cli",
        "run",
        "--server",
        server,
        "--node-id",
        node,
        "--bootstrap-token",
        bootstrap_token,
        "--state-dir",
        str(state_dir),
        *extra,
    ]
