"""NicCollector against a copied real sysfs tree, and the real ethtool ioctl on a veth pair."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.collectors.base import Roots
from agents.collectors.nic import NicCollector, RateTracker, read_ethtool_stats

FIXTURE_SYS = Path(__file__).resolve().parents[1] / "fixtures" / "sys"


class FakeClock:
    """A monotonic clock the test moves by hand, so rates are exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sys_tree(tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(FIXTURE_SYS, root)
    return root


def rows_by_key(samples) -> dict[tuple[str, str], object]:  # noqa: ANN001
    return {(r.iface, r.counter): r for r in samples.nics}


def hw(root: Path, dev: str, name: str) -> Path:
    return root / "class" / "infiniband" / dev / "ports" / "1" / "hw_counters" / name


async def test_rdma_counters_read_from_sysfs_with_real_names(sys_tree: Path) -> None:
    collector = NicCollector(Roots(sys=sys_tree), interfaces=[], clock=FakeClock())
    rows = rows_by_key(await collector.collect())
    assert rows[("mlx5_1/1", "rp_cnp_handled")].value == 144
    assert rows[("mlx5_1/1", "np_cnp_sent")].value == 0
    assert rows[("mlx5_1/1", "np_ecn_marked_roce_packets")].value == 0
    assert rows[("mlx5_1/1", "req_transport_retries_exceeded")].value == 19
    assert rows[("mlx5_0/1", "port_xmit_data")].value == 2880761508848
    assert rows[("mlx5_0/1", "link_downed")].value == 0
    assert rows[("mlx5_0/1", "out_of_buffer")].value == 0
    assert ("mlx5_0/1", "lifespan") not in rows  # a setting, not a counter
    assert all(r.rate is None for r in rows.values())  # first reading: no honest rate


async def test_rates_per_second_and_counter_reset(sys_tree: Path) -> None:
    clock = FakeClock()
    collector = NicCollector(Roots(sys=sys_tree), interfaces=[], clock=clock)
    await collector.collect()

    hw(sys_tree, "mlx5_1", "rp_cnp_handled").write_text("344\n")  # +200
    clock.now += 2.0
    rows = rows_by_key(await collector.collect())
    assert rows[("mlx5_1/1", "rp_cnp_handled")].rate == pytest.approx(100.0)
    assert rows[("mlx5_1/1", "np_cnp_sent")].rate == 0.0

    # Driver reload: the counter starts again from a small number.
    hw(sys_tree, "mlx5_1", "rp_cnp_handled").write_text("3\n")
    clock.now += 1.0
    rows = rows_by_key(await collector.collect())
    assert rows[("mlx5_1/1", "rp_cnp_handled")].value == 3
    assert rows[("mlx5_1/1", "rp_cnp_handled")].rate is None

    hw(sys_tree, "mlx5_1", "rp_cnp_handled").write_text("13\n")
    clock.now += 1.0
    rows = rows_by_key(await collector.collect())
    assert rows[("mlx5_1/1", "rp_cnp_handled")].rate == pytest.approx(10.0)


async def test_unreadable_counter_is_skipped_and_others_still_read(sys_tree: Path) -> None:
    hw(sys_tree, "mlx5_1", "np_cnp_sent").write_text("N/A\n")
    rows = rows_by_key(
        await NicCollector(Roots(sys=sys_tree), interfaces=[], clock=FakeClock()).collect()
    )
    assert ("mlx5_1/1", "np_cnp_sent") not in rows
    assert rows[("mlx5_1/1", "rp_cnp_handled")].value == 144


async def test_no_rdma_devices_is_no_data(tmp_path: Path) -> None:
    samples = await NicCollector(Roots(sys=tmp_path), interfaces=[]).collect()
    assert len(samples) == 0


async def test_interfaces_without_statistics_are_skipped_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="agents.collectors.nic")
    collector = NicCollector(Roots(sys=tmp_path), interfaces=["lo", "mwnic-absent0"])
    samples = await collector.collect()
    assert samples.nics == []
    assert any("mwnic-absent0" in r.getMessage() for r in caplog.records)
    assert all(r.levelno <= logging.DEBUG for r in caplog.records)


def test_rate_tracker_never_reports_a_negative_rate() -> None:
    tracker = RateTracker()
    rates = [
        tracker.update(("eth0", "tx_prio3_pause"), v, t)
        for t, v in enumerate([1000, 1010, 1020, 5, 15, 15])
    ]
    assert rates == [None, 10.0, 10.0, None, 10.0, 0.0]


# -- the real ioctl ------------------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2"
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def veth_pair() -> Iterator[tuple[str, str, str]]:
    """(local iface, peer iface, peer netns): a veth whose peer sits in its own netns."""
    tag = f"{os.getpid() % 100000}"
    netns, local, peer = f"mwnic-{tag}", f"mwnic-{tag}a", f"mwnic-{tag}b"
    try:
        ip("netns", "add", netns)
        ip("link", "add", local, "type", "veth", "peer", "name", peer, "netns", netns)
        ip("link", "set", local, "up")
        ip("-n", netns, "link", "set", peer, "up")
        yield local, peer, netns
    finally:
        subprocess.run(["ip", "link", "del", local], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def peer_ifindex(netns: str, peer: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "cat", f"/sys/class/net/{peer}/ifindex"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout)


@needs_root
@pytest.mark.lab
def test_ethtool_ioctl_reads_veth_statistics(veth_pair: tuple[str, str, str]) -> None:
    local, peer, netns = veth_pair
    stats = read_ethtool_stats(local)
    # veth answers ETHTOOL_GSTATS with its peer's ifindex: a value only the kernel knows.
    assert stats["peer_ifindex"] == peer_ifindex(netns, peer)
    assert "rx_queue_0_xdp_packets" in stats


@needs_root
@pytest.mark.lab
async def test_collector_reads_veth_through_ioctl(veth_pair: tuple[str, str, str]) -> None:
    local, peer, netns = veth_pair
    clock = FakeClock()
    collector = NicCollector(
        Roots(sys=Path("/nonexistent")),
        interfaces=[local],
        counter_filter=lambda name: name == "peer_ifindex",
        clock=clock,
    )
    [row] = (await collector.collect()).nics
    assert (row.iface, row.counter, row.value, row.rate) == (
        local,
        "peer_ifindex",
        peer_ifindex(netns, peer),
        None,
    )
    clock.now += 1.0
    [row] = (await collector.collect()).nics
    assert row.rate == 0.0

    # The default filter ships no per-queue counter, and veth has nothing else.
    default = NicCollector(Roots(sys=Path("/nonexistent")), interfaces=[local])
    assert (await default.collect()).nics == []
