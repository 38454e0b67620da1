"""CPU, load, memory and per-interface traffic counters of the node, from procfs.

Reads ``/proc/stat`` (CPU % from the delta between two readings), ``/proc/loadavg``,
``/proc/meminfo`` and ``/proc/net/dev``, every one through ``Roots.proc_path`` so
tests run the collector against a copied real tree.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from agents.collectors.base import Collector, Roots, Samples
from agents.protocol import HostSample, NicCounter

log = logging.getLogger(__name__)

# /proc/net/dev columns, in the order the kernel prints them (net/core/net-procfs.c).
_RX_COLUMNS = ("bytes", "packets", "errs", "drop", "fifo", "frame", "compressed", "multicast")
_TX_COLUMNS = ("bytes", "packets", "errs", "drop", "fifo", "colls", "carrier", "compressed")
# The counters shipped: traffic, errors and drops each way.
NET_DEV_COUNTERS = (
    "rx_bytes", "rx_packets", "rx_errs", "rx_drop",
    "tx_bytes", "tx_packets", "tx_errs", "tx_drop",
)
_IDENT = re.compile(r"^[A-Za-z0-9_.:@/+-]{1,128}$")  # protocol.Ident


@dataclass(frozen=True)
class CpuTimes:
    """The aggregate ``cpu`` line of /proc/stat, in USER_HZ ticks."""

    busy: int
    idle: int  # idle + iowait: time the CPUs had nothing to run

    @property
    def total(self) -> int:
        return self.busy + self.idle


def parse_proc_stat(text: str) -> CpuTimes:
    """The aggregate CPU times from /proc/stat text.

    guest and guest_nice are already counted in user and nice, so they are left
    out of the total (as procps does).
    """
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            ticks = [int(value) for value in fields[1:]]
            ticks += [0] * (8 - len(ticks))  # kernels before 2.6.11 print fewer columns
            user, nice, system, idle, iowait, irq, softirq, steal = ticks[:8]
            return CpuTimes(
                busy=user + nice + system + irq + softirq + steal, idle=idle + iowait
            )
    raise ValueError("no aggregate 'cpu' line in /proc/stat")


def parse_loadavg(text: str) -> float:
    """The one-minute load average from /proc/loadavg text."""
    return float(text.split()[0])


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {field: bytes}; fields given in kB are converted to bytes."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts:
            continue
        value = int(parts[0])
        if len(parts) > 1 and parts[1] == "kB":
            value *= 1024
        values[name.strip()] = value
    return values


def parse_net_dev(text: str) -> dict[str, dict[str, int]]:
    """/proc/net/dev as {iface: {"rx_bytes": n, "tx_drop": n, ...}} with every column."""
    interfaces: dict[str, dict[str, int]] = {}
    for line in text.splitlines()[2:]:  # two header lines
        name, sep, rest = line.partition(":")
        if not sep:
            continue
        numbers = [int(value) for value in rest.split()]
        if len(numbers) < len(_RX_COLUMNS) + len(_TX_COLUMNS):
            continue
        counters = {f"rx_{col}": numbers[i] for i, col in enumerate(_RX_COLUMNS)}
        offset = len(_RX_COLUMNS)
        counters.update({f"tx_{col}": numbers[offset + i] for i, col in enumerate(_TX_COLUMNS)})
        interfaces[name.strip()] = counters
    return interfaces


class HostCollector(Collector):
    """Node CPU %, load1 and memory (one ``HostSample``) and per-NIC counters with rates.

    CPU % needs two readings of /proc/stat; the constructor takes the first, so the
    first ``collect()`` already reports the CPU use since the collector was made.
    A rate is None on a counter's first reading and when it went backwards (the
    interface was re-created or its driver reloaded), where no honest rate exists.
    """

    name = "host"

    def __init__(
        self,
        roots: Roots | None = None,
        *,
        skip_ifaces: Collection[str] = ("lo",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.roots = roots if roots is not None else Roots.from_env()
        self.skip_ifaces = frozenset(skip_ifaces)
        self._clock = clock
        self._reported_missing: set[Path] = set()
        self._cpu: CpuTimes | None = None
        self._nic_previous: dict[tuple[str, str], tuple[int, float]] = {}
        stat = self._read("stat")
        if stat is not None:
            self._cpu = parse_proc_stat(stat)

    def _read(self, *parts: str) -> str | None:
        path = self.roots.proc_path(*parts)
        try:
            return path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            # Missing is "no data", said once.
            if path not in self._reported_missing:
                self._reported_missing.add(path)
                log.info("host collector: %s not found; nothing to report from it", path)
            return None

    async def collect(self) -> Samples:
        now = datetime.now(UTC)
        samples = Samples()
        host = self._host_sample(now)
        if host is not None:
            samples.hosts.append(host)
        samples.nics.extend(self._nic_counters(now))
        return samples

    def _cpu_pct(self) -> float | None:
        stat = self._read("stat")
        if stat is None:
            return None
        current = parse_proc_stat(stat)
        previous, self._cpu = self._cpu, current
        if previous is None:
            return None
        total = current.total - previous.total
        busy = current.busy - previous.busy
        if total <= 0 or busy < 0:
            return None  # no tick elapsed, or counters reset: no honest figure
        return min(100.0, max(0.0, 100.0 * busy / total))

    def _host_sample(self, now: datetime) -> HostSample | None:
        cpu_pct = self._cpu_pct()
        loadavg = self._read("loadavg")
        meminfo_text = self._read("meminfo")
        if cpu_pct is None or loadavg is None or meminfo_text is None:
            return None
        meminfo = parse_meminfo(meminfo_text)
        total = meminfo.get("MemTotal")
        if total is None:
            return None
        # MemAvailable exists since Linux 3.14; before that free + page cache is the estimate.
        available = meminfo.get("MemAvailable")
        if available is None:
            available = meminfo.get("MemFree", 0) + meminfo.get("Cached", 0)
        return HostSample(
            ts=now,
            cpu_pct=cpu_pct,
            load1=parse_loadavg(loadavg),
            mem_total_bytes=total,
            mem_available_bytes=available,
        )

    def _nic_counters(self, now: datetime) -> list[NicCounter]:
        text = self._read("net", "dev")
        if text is None:
            return []
        at = self._clock()
        counters: list[NicCounter] = []
        seen: dict[tuple[str, str], tuple[int, float]] = {}
        for iface, values in parse_net_dev(text).items():
            if iface in self.skip_ifaces or not _IDENT.match(iface):
                continue
            for counter in NET_DEV_COUNTERS:
                value = values[counter]
                rate: float | None = None
                previous = self._nic_previous.get((iface, counter))
                if previous is not None:
                    previous_value, previous_at = previous
                    elapsed = at - previous_at
                    if value >= previous_value and elapsed > 0:
                        rate = (value - previous_value) / elapsed
                seen[(iface, counter)] = (value, at)
                counters.append(
                    NicCounter(ts=now, iface=iface, counter=counter, value=value, rate=rate)
                )
        # Interfaces that went away are forgotten, so a re-created one starts afresh.
        self._nic_previous = seen
        return counters
