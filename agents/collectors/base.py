"""The small interface every collector implements.

A collector has a ``name``, an ``interval`` in seconds and an async
``collect()`` that returns the ``Samples`` observed since the last call.
Missing hardware is "no data", not an error: a collector that finds nothing
to read returns empty ``Samples`` (and says so once in the log).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from agents.protocol import Event, GpuSample, HostSample, NicCounter, ProbeStat


@dataclass
class Samples:
    probes: list[ProbeStat] = field(default_factory=list)
    hosts: list[HostSample] = field(default_factory=list)
    gpus: list[GpuSample] = field(default_factory=list)
    nics: list[NicCounter] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    # Ship at once rather than at the next batch tick: something a detector is
    # racing to see (a pause storm building, an Xid, a collective timeout).
    urgent: bool = False

    def extend(self, other: Samples) -> None:
        self.urgent = self.urgent or other.urgent
        self.probes.extend(other.probes)
        self.hosts.extend(other.hosts)
        self.gpus.extend(other.gpus)
        self.nics.extend(other.nics)
        self.events.extend(other.events)

    def __len__(self) -> int:
        return (
            len(self.probes) + len(self.hosts) + len(self.gpus) + len(self.nics) + len(self.events)
        )


@dataclass(frozen=True)
class Roots:
    """Where the collectors read the kernel's files from.

    Tests point these at a fake tree under tests/fixtures that copies real
    machines' files; in production they are / (or /host when the agent runs
    in a container with the host's filesystems mounted there).
    """

    sys: Path = Path("/sys")
    proc: Path = Path("/proc")
    dev: Path = Path("/dev")

    @classmethod
    def from_env(cls) -> Roots:
        root = Path(os.environ.get("MESHWATCH_HOST_ROOT", "/"))
        return cls(sys=root / "sys", proc=root / "proc", dev=root / "dev")

    def sys_path(self, *parts: str) -> Path:
        return self.sys.joinpath(*parts)

    def proc_path(self, *parts: str) -> Path:
        return self.proc.joinpath(*parts)


class Collector:
    """Base class: subclasses set ``name`` and implement ``collect``."""

    name: ClassVar[str]
    interval: float = 1.0

    async def collect(self) -> Samples:  # pragma: no cover - interface
        raise NotImplementedError

    async def close(self) -> None:
        """Release files, sockets or library handles. Default: nothing to do."""
