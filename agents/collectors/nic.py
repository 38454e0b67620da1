"""NIC counters: ethtool statistics (pause/PFC, discards, errors) and RDMA port counters.

Ethtool statistics are read straight from the kernel with the SIOCETHTOOL
ioctl (ETHTOOL_GSSET_INFO for the count, ETHTOOL_GSTRINGS for the names,
ETHTOOL_GSTATS for the values), the same calls ``ethtool -S`` makes, so no
binary is needed. Pause figures are shipped under their canonical mlx5-style
names (``tx_prio3_pause``, ``tx_prio3_pause_duration``, ``tx_pause``; see
``agents.parsers.ethtool``) whatever the driver calls them; other kept counters
keep the driver's name.

RDMA counters come from ``{sys}/class/infiniband/DEV/ports/PORT/counters/*``
and ``.../hw_counters/*`` and are reported with ``iface="DEV/PORT"`` (the
``rdma`` tool's spelling, e.g. ``mlx5_0/1``).

Each row carries the rate per second against the previous reading; the first
reading and a reading below the previous one (a driver reload reset the
counter) carry ``rate=None``.
"""

from __future__ import annotations

import array
import asyncio
import errno
import fcntl
import logging
import socket
import struct
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import ClassVar

from agents.collectors.base import Collector, Roots, Samples
from agents.parsers.ethtool import canonical_name, classify_counter, keep_counter
from agents.protocol import NicCounter

log = logging.getLogger(__name__)

SIOCETHTOOL = 0x8946
ETHTOOL_GSTRINGS = 0x0000001B
ETHTOOL_GSTATS = 0x0000001D
ETHTOOL_GSSET_INFO = 0x00000037
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16
_IFREQ_SIZE = 40  # struct ifreq on 64-bit Linux

# Answers that mean "this interface has no ethtool statistics": skip it quietly.
_NO_STATS_ERRNOS = {errno.EOPNOTSUPP, errno.ENODEV, errno.ENXIO, errno.EINVAL, errno.ENOTSUP}

# hw_counters files that are settings, not counters.
_RDMA_NOT_COUNTERS = {"lifespan"}


class EthtoolError(OSError):
    """The kernel refused an ethtool request for an interface."""


def _ethtool_ioctl(sock: socket.socket, iface: str, buf: array.array) -> None:
    name = iface.encode()
    if len(name) >= IFNAMSIZ:
        raise EthtoolError(errno.EINVAL, f"interface name too long: {iface}")
    address, _ = buf.buffer_info()
    ifreq = struct.pack(f"{IFNAMSIZ}sP", name, address).ljust(_IFREQ_SIZE, b"\x00")
    fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)


def ethtool_stat_count(sock: socket.socket, iface: str) -> int:
    """How many statistics ``iface`` reports (ETHTOOL_GSSET_INFO for ETH_SS_STATS)."""
    buf = array.array("B", struct.pack("IIQI", ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS, 0))
    _ethtool_ioctl(sock, iface, buf)
    _, _, mask, count = struct.unpack("IIQI", buf.tobytes())
    return count if mask & (1 << ETH_SS_STATS) else 0


def ethtool_stat_names(sock: socket.socket, iface: str, count: int) -> list[str]:
    """The ``count`` statistic names of ``iface`` (ETHTOOL_GSTRINGS)."""
    header = struct.pack("III", ETHTOOL_GSTRINGS, ETH_SS_STATS, 0)
    buf = array.array("B", header + bytes(count * ETH_GSTRING_LEN))
    _ethtool_ioctl(sock, iface, buf)
    raw = buf.tobytes()
    _, _, length = struct.unpack_from("III", raw)
    names = []
    for i in range(min(length, count)):
        start = 12 + i * ETH_GSTRING_LEN
        name = raw[start : start + ETH_GSTRING_LEN].split(b"\x00", 1)[0]
        names.append(name.decode(errors="replace"))
    return names


def ethtool_stat_values(sock: socket.socket, iface: str, count: int) -> list[int]:
    """The ``count`` statistic values of ``iface`` (ETHTOOL_GSTATS)."""
    buf = array.array("B", struct.pack("II", ETHTOOL_GSTATS, count) + bytes(count * 8))
    _ethtool_ioctl(sock, iface, buf)
    raw = buf.tobytes()
    _, n = struct.unpack_from("II", raw)
    return list(struct.unpack_from(f"{min(n, count)}Q", raw, 8))


def read_ethtool_stats(iface: str) -> dict[str, int]:
    """All ethtool statistics of ``iface`` in the caller's network namespace.

    Raises ``OSError`` (errno EOPNOTSUPP, ENODEV, ...) where the interface has
    none or does not exist.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        count = ethtool_stat_count(sock, iface)
        if count == 0:
            return {}
        names = ethtool_stat_names(sock, iface, count)
        values = ethtool_stat_values(sock, iface, count)
    return dict(zip(names, values, strict=False))


class RateTracker:
    """Rates per second from successive readings of monotonically growing counters."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[float, float]] = {}

    def update(self, key: tuple[str, str], value: float, now: float) -> float | None:
        """Record ``value`` at monotonic time ``now``; the rate since the last reading.

        None on the first reading, when no time passed, and when the value went
        down (a driver reload or a wrap reset the counter: no honest rate).
        """
        previous = self._last.get(key)
        self._last[key] = (value, now)
        if previous is None:
            return None
        last_value, last_time = previous
        elapsed = now - last_time
        if value < last_value or elapsed <= 0:
            return None
        return (value - last_value) / elapsed

    def forget(self, keep: set[tuple[str, str]]) -> None:
        """Drop readings of counters that were not seen (interface gone)."""
        for key in list(self._last):
            if key not in keep:
                del self._last[key]


class NicCollector(Collector):
    """Pause/PFC, discard and error counters of the NICs, plus RDMA port counters."""

    name: ClassVar[str] = "nic"

    def __init__(
        self,
        roots: Roots,
        interfaces: list[str] | None = None,
        *,
        counter_filter: Callable[[str], bool] = keep_counter,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``interfaces`` None: every interface but ``lo``; ``[]``: RDMA counters only."""
        self.roots = roots
        self.interfaces = interfaces
        self.counter_filter = counter_filter
        self.clock = clock
        self._rates = RateTracker()
        self._skipped: set[str] = set()

    async def collect(self) -> Samples:
        return await asyncio.to_thread(self.collect_now)

    def collect_now(self) -> Samples:
        """One reading of every counter (blocking; ``collect`` runs it in a thread)."""
        ts = datetime.now(UTC)
        now = self.clock()
        readings: list[tuple[str, str, int]] = []
        for iface in self._ethtool_interfaces():
            readings.extend((iface, c, v) for c, v in self._ethtool_counters(iface).items())
        readings.extend(self._rdma_counters())

        samples = Samples()
        seen: set[tuple[str, str]] = set()
        for iface, counter, value in readings:
            key = (iface, counter)
            seen.add(key)
            rate = self._rates.update(key, value, now)
            samples.nics.append(
                NicCounter(ts=ts, iface=iface, counter=counter, value=value, rate=rate)
            )
        self._rates.forget(seen)
        return samples

    def _ethtool_interfaces(self) -> list[str]:
        if self.interfaces is not None:
            return list(self.interfaces)
        return sorted(name for _, name in socket.if_nameindex() if name != "lo")

    def _ethtool_counters(self, iface: str) -> dict[str, int]:
        try:
            stats = read_ethtool_stats(iface)
        except OSError as exc:
            if exc.errno in _NO_STATS_ERRNOS:
                if iface not in self._skipped:
                    log.debug("nic: %s has no ethtool statistics (%s); skipped", iface, exc)
                    self._skipped.add(iface)
                return {}
            raise
        kept: dict[str, int] = {}
        for name, value in stats.items():
            if not self.counter_filter(name):
                continue
            pause = classify_counter(name)
            out = canonical_name(*pause) if pause else name
            # Two driver names for one canonical figure (mlx5 tx_pause_ctrl_phy and
            # tx_global_pause): keep the first, as the parser does.
            kept.setdefault(out, value)
        return kept

    def _rdma_counters(self) -> list[tuple[str, str, int]]:
        base = self.roots.sys_path("class", "infiniband")
        if not base.is_dir():
            return []
        out: list[tuple[str, str, int]] = []
        for device in sorted(base.iterdir()):
            ports = device / "ports"
            if not ports.is_dir():
                continue
            for port in sorted(ports.iterdir()):
                iface = f"{device.name}/{port.name}"
                for group in ("counters", "hw_counters"):
                    folder = port / group
                    if not folder.is_dir():
                        continue
                    for counter in sorted(folder.iterdir()):
                        if counter.name in _RDMA_NOT_COUNTERS or not counter.is_file():
                            continue
                        value = _read_int(counter)
                        if value is not None:
                            out.append((iface, counter.name, value))
        return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        # Some counters refuse reads on some firmware (EINVAL); that counter is "no data".
        return None
    try:
        value = int(text, 16) if text.startswith("0x") else int(text)
    except ValueError:
        return None
    return value if value >= 0 else None
