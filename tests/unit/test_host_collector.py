"""The host collector against a copied real /proc tree and against this machine's /proc."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import time
from pathlib import Path

from agents.collectors.base import Roots
from agents.collectors.host import NET_DEV_COUNTERS, HostCollector, parse_proc_stat

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "proc"
NEXT = FIXTURE / "next-second"


class StepClock:
    """A monotonic clock that moves one second per reading, so rates are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _proc_copy(tmp_path: Path) -> Path:
    proc = tmp_path / "proc"
    shutil.copytree(FIXTURE, proc, ignore=shutil.ignore_patterns("next-second", "SOURCES.md"))
    return proc


def _advance(proc: Path, source: Path) -> None:
    shutil.copy(source / "stat", proc / "stat")
    shutil.copy(source / "net" / "dev", proc / "net" / "dev")


async def test_fixture_cpu_load_and_memory(tmp_path: Path) -> None:
    proc = _proc_copy(tmp_path)
    collector = HostCollector(Roots(proc=proc), clock=StepClock())

    first = await collector.collect()
    assert first.hosts == []  # /proc/stat unchanged since the constructor read it: no CPU figure

    _advance(proc, NEXT)
    second = await collector.collect()
    [host] = second.hosts
    # cpu lines of the two captures: busy 8233+3316+95+18 -> 8292+3361+110+18 (+119),
    # idle+iowait 76465+461 -> 76579+461 (+114).
    assert abs(host.cpu_pct - 100 * 119 / 233) < 1e-9
    assert host.load1 == 0.0
    assert host.mem_total_bytes == 24684092 * 1024
    assert host.mem_available_bytes == 24133964 * 1024


async def test_fixture_nic_counters_and_rates(tmp_path: Path) -> None:
    proc = _proc_copy(tmp_path)
    collector = HostCollector(Roots(proc=proc), clock=StepClock())

    first = {(c.iface, c.counter): c for c in (await collector.collect()).nics}
    assert {iface for iface, _ in first} == {"ifb0", "ifb1", "eth0"}  # lo skipped
    assert {counter for _, counter in first} == set(NET_DEV_COUNTERS)
    assert first[("eth0", "rx_bytes")].value == 128938831
    assert first[("eth0", "tx_packets")].value == 1942
    assert all(c.rate is None for c in first.values())

    _advance(proc, NEXT)
    second = {(c.iface, c.counter): c for c in (await collector.collect()).nics}
    assert second[("eth0", "rx_bytes")].rate == 0.0  # eth0 idle during the captured second
    assert all(c.rate is not None for c in second.values())


async def test_fixture_rate_from_loopback_traffic_and_none_when_counter_goes_back(
    tmp_path: Path,
) -> None:
    proc = _proc_copy(tmp_path)
    collector = HostCollector(Roots(proc=proc), skip_ifaces=(), clock=StepClock())
    await collector.collect()

    _advance(proc, NEXT)
    later = {(c.iface, c.counter): c for c in (await collector.collect()).nics}
    assert later[("lo", "rx_bytes")].rate == 217408385 - 41897
    assert later[("lo", "tx_packets")].rate == 212027 - 581

    # The earlier capture again: lo's counters went backwards, as after a driver reload.
    _advance(proc, FIXTURE)
    reset = {(c.iface, c.counter): c for c in (await collector.collect()).nics}
    assert reset[("lo", "rx_bytes")].rate is None
    assert reset[("lo", "rx_bytes")].value == 41897
    assert reset[("eth0", "rx_bytes")].rate == 0.0


async def test_missing_proc_files_mean_no_data(tmp_path: Path) -> None:
    collector = HostCollector(Roots(proc=tmp_path / "nothing-here"))
    samples = await collector.collect()
    assert len(samples) == 0


async def test_real_proc() -> None:
    collector = HostCollector(Roots())
    await collector.collect()  # first NIC readings: rates from here on
    deadline = time.monotonic() + 10
    hosts = []
    while not hosts:
        assert time.monotonic() < deadline, "no CPU tick elapsed within 10 s"
        await asyncio.sleep(0.05)
        load_before = os.getloadavg()[0]
        samples = await collector.collect()
        load_after = os.getloadavg()[0]
        hosts = samples.hosts
    [host] = hosts
    assert 0.0 <= host.cpu_pct <= 100.0
    assert host.mem_total_bytes == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < host.mem_available_bytes <= host.mem_total_bytes
    # /proc/loadavg prints two decimals of what getloadavg() returns in full.
    assert any(abs(host.load1 - load) <= 0.01 for load in (load_before, load_after))

    ifaces = {name for _, name in socket.if_nameindex()} - {"lo"}
    assert {c.iface for c in samples.nics} == ifaces
    assert all(c.rate is not None and c.rate >= 0 for c in samples.nics)
    cpu = parse_proc_stat(Path("/proc/stat").read_text())
    assert cpu.total > 0
