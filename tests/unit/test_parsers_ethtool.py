"""ethtool -S parsing and pause/PFC figures, on real captured outputs (tests/fixtures/ethtool)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agents.parsers.ethtool import (
    canonical_name,
    classify_counter,
    keep_counter,
    parse_ethtool_stats,
    parse_lines,
    pfc_figures,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ethtool"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def by_priority(figures: list[dict]) -> dict:
    return {f["priority"]: f for f in figures}


def test_every_fixture_is_named_in_sources() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text()
    for path in FIXTURES.glob("*.txt"):
        assert f"`{path.name}`" in sources, path.name


def test_mlx5_counters_parse_with_exact_values() -> None:
    stats = parse_ethtool_stats(fixture("mlx5_core_kernel5.15.txt"))
    assert "NIC statistics" not in " ".join(stats)
    assert len(stats) == 101
    assert stats["tx_pause_ctrl_phy"] == 5745055
    assert stats["rx_discards_phy"] == 58591428329
    assert stats["rx_out_of_buffer"] == 990473555
    assert stats["rx0_xdp_tx_cqes"] == 87229139


def test_mlx5_global_pause_figures() -> None:
    figures = by_priority(pfc_figures(parse_ethtool_stats(fixture("mlx5_core_kernel6.5.txt"))))
    # Only link-level pause on this box: no per-priority entry is made up.
    assert list(figures) == [None]
    link = figures[None]
    assert link["tx_pause"] == 44414017  # tx_pause_ctrl_phy wins over tx_global_pause
    assert link["tx_pause_duration"] == 5961284324
    assert link["rx_pause"] is None  # the poster dropped zero counters; absent is unknown


def test_bnxt_per_priority_frames_and_durations() -> None:
    stats = parse_ethtool_stats(fixture("bnxt_en.txt"))
    assert stats["[0]:rx_discards"] == 11763190
    assert stats["[1]:rx_discards"] == 10611365
    assert stats["rx_total_ring_discards"] == 655430134
    figures = by_priority(pfc_figures(stats))
    assert sorted(p for p in figures if p is not None) == list(range(8))
    for p in range(8):
        assert figures[p] == {
            "priority": p,
            "rx_pause": 0,
            "tx_pause": 0,
            "rx_pause_duration": 0,
            "tx_pause_duration": 0,
        }
    link = figures[None]
    assert link["rx_pause"] == 0 and link["tx_pause"] == 0
    assert link["rx_pfc_frames"] == 0 and link["tx_pfc_frames"] == 0


def test_ice_priority_xoff_counts_from_intel_guide() -> None:
    stats = parse_ethtool_stats(fixture("ice_grep_prio_intel_guide.txt"))
    figures = by_priority(pfc_figures(stats))
    assert figures[2]["tx_pause"] == 14864
    assert figures[3]["tx_pause"] == 6434
    assert figures[4]["tx_pause"] == 0
    assert all(figures[p]["rx_pause"] == 0 for p in range(8))
    # ice has no pause duration counters: unknown, not zero.
    assert figures[3]["tx_pause_duration"] is None
    # XON (resume) frames are not pauses: tx_priority_2_xon.nic is 2, never reported.
    assert all(figures[p]["tx_pause"] != 2 for p in range(8))
    assert None not in figures  # a grep for "prio" shows no link-level counter


def test_ice_full_output_keeps_port_counters_not_queues() -> None:
    [group] = list(parse_lines(fixture("ice.txt").splitlines()))
    counters = group["counters"]
    assert not any(name.startswith(("tx_queue_", "rx_queue_")) for name in counters)
    assert counters["rx_priority_3_xoff.nic"] == 0
    assert counters["rx_crc_errors.nic"] == 0
    assert "rx_bytes.nic" not in counters
    link = by_priority(group["pfc"])[None]
    assert link["rx_pause"] == 0 and link["tx_pause"] == 0  # link_xoff_{rx,tx}.nic


@pytest.mark.parametrize(
    ("name", "kept"),
    [
        ("rx_discards_phy", True),
        ("tx_pause_ctrl_phy", True),
        ("rx_prio0_discards", True),
        ("tx_pause_storm_error_events", True),
        ("pfc_pri3_tx_duration_us", True),
        ("rx_prio0_bytes", False),  # traffic volume, not a fault
        ("rx0_xdp_drop", False),  # per-ring
        ("tx_queue_9_bytes", False),
        ("[0]:rx_discards", False),  # bnxt per-ring
        ("ch0_events", False),
        ("rx_packets", False),
    ],
)
def test_keep_counter(name: str, kept: bool) -> None:
    assert keep_counter(name) is kept


def test_parse_lines_splits_concatenated_captures_and_names_interfaces() -> None:
    text = (
        "$ ethtool -S ens1f0np0\n"
        + fixture("mlx5_core_kernel5.15.txt")
        + "$ ethtool -S enp59s0f0\n"
        + fixture("ice_grep_prio_intel_guide.txt")
        + fixture("bnxt_en.txt")  # begins with its own "NIC statistics:" header
    )
    groups = list(parse_lines(text.splitlines(keepends=True)))
    assert [g["iface"] for g in groups] == ["ens1f0np0", "enp59s0f0", None]
    assert groups[0]["counters"]["tx_pause_ctrl_phy"] == 5745055
    assert by_priority(groups[1]["pfc"])[2]["tx_pause"] == 14864
    assert by_priority(groups[2]["pfc"])[7]["rx_pause_duration"] == 0
    json.dumps(groups)  # what `meshwatch-agent parse ethtool` prints must serialise


def test_parse_lines_on_text_without_counters_yields_nothing() -> None:
    assert list(parse_lines(["Pause parameters for eth03:", "RX:\t\ton", ""])) == []


@pytest.mark.parametrize(
    ("driver_name", "canonical"),
    [
        ("tx_prio3_pause", "tx_prio3_pause"),  # mlx5
        ("rx_prio3_pause_duration", "rx_prio3_pause_duration"),
        ("tx_pfc_ena_frames_pri3", "tx_prio3_pause"),  # bnxt_en
        ("pfc_pri3_rx_duration_us", "rx_prio3_pause_duration"),
        ("rx_priority_3_xoff.nic", "rx_prio3_pause"),  # ice
        ("port.tx_priority_5_xoff", "tx_prio5_pause"),  # i40e
        ("tx_pause_ctrl_phy", "tx_pause"),  # mlx5 link level
        ("rx_global_pause_duration", "rx_pause_duration"),
        ("link_xoff_tx.nic", "tx_pause"),
    ],
)
def test_driver_names_map_to_canonical_names(driver_name: str, canonical: str) -> None:
    classified = classify_counter(driver_name)
    assert classified is not None
    assert canonical_name(*classified) == canonical


@pytest.mark.parametrize("name", ["tx_priority_3_xon.nic", "rx_prio3_bytes", "tx_pfc_frames"])
def test_non_pause_names_are_not_classified(name: str) -> None:
    assert classify_counter(name) is None
