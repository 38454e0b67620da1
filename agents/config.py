"""The agent's configuration: flags > environment (MESHWATCH_*) > TOML file > defaults.

Every field of ``AgentConfig`` can come from each source under the same name:
``--spool-max-bytes`` on the command line, ``MESHWATCH_SPOOL_MAX_BYTES`` in the
environment, ``spool_max_bytes`` (or ``spool-max-bytes``) in the TOML file named
by ``--config`` or ``MESHWATCH_CONFIG``. List fields take a TOML array or a
comma-separated string.
"""

from __future__ import annotations

import dataclasses
import fcntl
import ipaddress
import os
import re
import socket
import struct
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from agents.collectors import COLLECTORS

ENV_PREFIX = "MESHWATCH_"
DEFAULT_COLLECTORS = ("host", "pingmesh", "xid", "nic", "gpu")
_IDENT = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")  # protocol.Ident


class ConfigError(ValueError):
    """A configuration value that cannot be used, naming the field and its source."""


def default_state_dir() -> Path:
    """/var/lib/meshwatch-agent for root, else the XDG state folder of the user."""
    if os.geteuid() == 0:
        return Path("/var/lib/meshwatch-agent")
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "meshwatch-agent"


def _default_route_iface(proc: Path = Path("/proc")) -> str | None:
    try:
        lines = (proc / "net" / "route").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "00000000" and fields[7] == "00000000":
            return fields[0]
    return None


def _iface_ipv4(iface: str) -> str | None:
    """The IPv4 address of ``iface`` (SIOCGIFADDR), without sending anything."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            request = struct.pack("256s", iface.encode()[:15])
            answer = fcntl.ioctl(sock.fileno(), siocgifaddr, request)
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])


def iface_of_address(address: str) -> str | None:
    """The name of the local interface that holds IPv4 ``address``, if any."""
    for _, name in socket.if_nameindex():
        if _iface_ipv4(name) == address:
            return name
    return None


def default_address() -> str:
    """The address of the interface holding the default route, else 127.0.0.1."""
    iface = _default_route_iface()
    address = _iface_ipv4(iface) if iface else None
    return address or "127.0.0.1"


def default_node_id() -> str:
    return socket.gethostname().split(".")[0] or "localhost"


@dataclass
class AgentConfig:
    """Everything the agent daemon needs to run. See the module docstring for sources."""

    server: str = "http://127.0.0.1:8000"
    node_id: str = field(default_factory=default_node_id)
    rack: str | None = None
    pod: str | None = None
    address: str = field(default_factory=default_address)
    probe_port: int = 7447
    probe_bind_host: str = "0.0.0.0"
    flows: int = 4
    dscp: int = 0
    collectors: list[str] = field(default_factory=lambda: list(DEFAULT_COLLECTORS))
    nccl_log_globs: list[str] = field(default_factory=list)
    job_id: str | None = None
    state_dir: Path = field(default_factory=default_state_dir)
    spool_max_bytes: int = 256 * 1024 * 1024
    batch_interval: float = 1.0
    pinglist_interval: float = 10.0
    final_flush_seconds: float = 3.0
    bootstrap_token: str | None = None
    log_level: str = "info"
    # Benchmark tasks (slow-node bisection) handed out by the backend.
    tasks: bool = True
    allowed_commands: list[str] = field(default_factory=list)  # for `command` tasks; "*" = any
    # Caps this node's benchmark sends, in bits/s: a lab knob that makes a node slow for real.
    bench_send_limit_bps: float | None = None

    @property
    def spool_dir(self) -> Path:
        return self.state_dir / "spool"

    @property
    def token_path(self) -> Path:
        return self.state_dir / "token.json"

    def validate(self) -> AgentConfig:
        """Raise ``ConfigError`` naming the first field that cannot work."""
        url = urlsplit(self.server)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ConfigError(f"server: {self.server!r} is not an http(s) URL")
        for name in ("node_id", "rack", "pod", "job_id"):
            value = getattr(self, name)
            if value is not None and not _IDENT.match(value):
                raise ConfigError(
                    f"{name}: {value!r} may hold only letters, digits and _.:@/+- (1-128 chars)"
                )
        try:
            ipaddress.ip_address(self.address)
        except ValueError:
            raise ConfigError(f"address: {self.address!r} is not an IP address") from None
        if not 1 <= self.probe_port <= 65535:
            raise ConfigError(f"probe_port: {self.probe_port} is not a port")
        if not 1 <= self.flows <= 64:
            raise ConfigError(f"flows: {self.flows} is outside 1..64")
        if not 0 <= self.dscp <= 63:
            raise ConfigError(f"dscp: {self.dscp} is outside 0..63")
        unknown = [name for name in self.collectors if name not in COLLECTORS]
        if unknown:
            raise ConfigError(
                f"collectors: unknown {', '.join(unknown)} (known: {', '.join(sorted(COLLECTORS))})"
            )
        if self.spool_max_bytes <= 0:
            raise ConfigError("spool_max_bytes must be positive")
        for name in ("batch_interval", "pinglist_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")
        if self.final_flush_seconds < 0:
            raise ConfigError("final_flush_seconds must not be negative")
        return self


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(AgentConfig)}


def _convert(name: str, value: Any, source: str) -> Any:
    """Turn a raw value (a string from env, a TOML value, a flag) into the field's type."""
    kind = str(FIELDS[name].type)
    try:
        if value is None:
            return None
        if kind.startswith("list"):
            if isinstance(value, str):
                return [part.strip() for part in value.split(",") if part.strip()]
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise TypeError("expected a list of strings")
            return list(value)
        if kind == "int":
            if isinstance(value, bool):
                raise TypeError("expected an integer")
            return int(value)
        if kind in ("float", "float | None"):
            return float(value)
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if kind == "Path":
            return Path(value).expanduser()
        if not isinstance(value, str):
            raise TypeError("expected a string")
        if kind == "str | None" and value == "":
            return None
        return value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{name} from {source}: {value!r}: {exc}") from None


def env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The fields set through MESHWATCH_<FIELD> environment variables."""
    values: dict[str, Any] = {}
    for name in FIELDS:
        key = ENV_PREFIX + name.upper()
        if key in env:
            values[name] = _convert(name, env[key], f"${key}")
    return values


def file_values(path: Path) -> dict[str, Any]:
    """The fields set in a TOML file; keys may be spelt with _ or -. Unknown keys are errors."""
    try:
        with path.open("rb") as handle:
            raw = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path}: {exc}") from None
    # Accept a top-level [agent] table as well as top-level keys.
    if isinstance(raw.get("agent"), dict):
        raw = raw["agent"]
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            raise ConfigError(f"config file {path}: unknown key {key!r}")
        values[name] = _convert(name, value, str(path))
    return values


def load_config(
    flags: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> AgentConfig:
    """Build the config from flags (only those given), env and an optional TOML file.

    Precedence: flags > env > file > defaults. The file is ``config_file``, else
    ``$MESHWATCH_CONFIG`` when set.
    """
    env = os.environ if env is None else env
    flags = {k: v for k, v in (flags or {}).items() if v is not None and k in FIELDS}
    if config_file is None and env.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(env[ENV_PREFIX + "CONFIG"])
    merged: dict[str, Any] = {}
    if config_file is not None:
        merged.update(file_values(config_file))
    merged.update(env_values(env))
    merged.update({name: _convert(name, value, "flag") for name, value in flags.items()})
    return AgentConfig(**merged).validate()
