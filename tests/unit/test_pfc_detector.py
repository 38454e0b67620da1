"""PfcStormDetector and find_deadlock_cycles on synthetic per-second rate series."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from agents.collectors.nic import RateTracker
from app.analysis.pfc import (
    PfcSample,
    PfcStormConfig,
    PfcStormDetector,
    StormFinding,
    find_deadlock_cycles,
    samples_from_counter_rates,
)

T0 = datetime(2025, 3, 1, 12, 0, 0, tzinfo=UTC)
CONFIG = PfcStormConfig(threshold_pps=500, detection_window_s=2, restoration_window_s=3)


def at(second: float) -> datetime:
    return T0 + timedelta(seconds=second)


def run(
    series: dict[tuple[str, str, int], list[dict]], config: PfcStormConfig = CONFIG
) -> list[list[StormFinding]]:
    """Feed one sample per port per second and evaluate after each second."""
    detector = PfcStormDetector(config)
    length = max(len(v) for v in series.values())
    out = []
    for second in range(length):
        for (node, iface, prio), rows in series.items():
            if second < len(rows) and rows[second] is not None:
                detector.observe(PfcSample(node, iface, prio, at(second), **rows[second]))
        out.append(detector.evaluate(at(second)))
    return out


def tx(*rates: float | None) -> list[dict]:
    return [{"tx_pause_rate": r} for r in rates]


def rx(*rates: float | None) -> list[dict]:
    return [{"rx_pause_rate": r} for r in rates]


def storms(findings: list[StormFinding]) -> set[tuple[str, str, int | None]]:
    return {f.source for f in findings if f.state == "storm"}


def test_sustained_tx_pauses_open_a_storm_after_the_window() -> None:
    result = run({("n1", "eth0", 3): tx(0, 0, 0, 2000, 2000, 2000, 2000)})
    assert [bool(r) for r in result] == [False, False, False, False, True, True, True]
    finding = result[4][0]
    assert finding.state == "storm"
    assert finding.source == ("n1", "eth0", 3)
    assert finding.first_seen == at(2)  # the first over-threshold second began at t=2
    assert finding.detected_at == at(4)
    assert finding.evidence["peak_tx_pause_pps"] == 2000
    assert finding.evidence["threshold_pps"] == 500


def test_burst_shorter_than_the_window_opens_nothing() -> None:
    result = run({("n1", "eth0", 3): tx(0, 3000, 0, 0, 5000, 0, 0, 0)})
    assert all(r == [] for r in result)


def test_paused_time_fraction_alone_is_a_storm() -> None:
    # Few frames, each with the longest pause: the port is paused 90 % of every second.
    rows = [{"tx_pause_rate": 20, "tx_pause_duration_rate": 900_000}] * 4
    result = run({("n1", "eth0", 3): rows})
    assert storms(result[2]) == {("n1", "eth0", 3)}
    assert result[2][0].evidence["peak_paused_fraction"] == 0.9


def test_slow_ramp_is_detected_once_over_threshold_for_the_window() -> None:
    ramp = [100.0 * i for i in range(15)]  # reaches 500 pps in the second ending at t=5
    result = run({("n1", "eth0", 3): tx(*ramp)})
    first = next(i for i, r in enumerate(result) if r)
    assert first == 6
    assert result[first][0].first_seen == at(4)


def test_counter_reset_after_driver_reload_is_no_spike() -> None:
    # Raw tx_prio3_pause values; the driver reloads at t=3 and the counter restarts.
    raw = [1_000_000, 1_000_010, 1_000_020, 5, 15, 25, 35]
    tracker = RateTracker()
    rates = [tracker.update(("eth0", "tx_prio3_pause"), v, t) for t, v in enumerate(raw)]
    assert rates == [None, 10.0, 10.0, None, 10.0, 10.0, 10.0]
    assert all(r == [] for r in run({("n1", "eth0", 3): tx(*rates)}))

    # Rates computed carelessly across a reset or a wrap are refused, not believed.
    garbage = tx(10, -999_990, 1.8e19, 1e12, 10, 10)
    assert all(r == [] for r in run({("n1", "eth0", 3): garbage}))


def test_reset_during_a_storm_neither_breaks_nor_ends_it() -> None:
    result = run({("n1", "eth0", 3): tx(2000, 2000, 2000, None, 2000, None, None, 2000)})
    assert all(storms(r) == {("n1", "eth0", 3)} for r in result[2:])
    assert all(f.state == "storm" for r in result for f in r)


def test_two_storms_at_once_each_with_its_victims() -> None:
    series = {
        ("n1", "eth0", 3): tx(0, 0, 0, 0, 3000, 3000, 3000, 3000, 3000),
        ("n5", "eth0", 3): tx(0, 0, 0, 0, 0, 2500, 2500, 2500, 2500),
        ("n2", "eth0", 3): rx(0, 0, 0, 0, 800, 900, 900, 900, 900),  # being paused
        ("n3", "eth0", 3): rx(0, 0, 0, 0, 0, 0, 0, 0, 0),  # not affected
        ("n4", "eth0", 0): rx(0, 0, 0, 0, 900, 900, 900, 900, 900),  # other priority
    }
    result = run(series)
    last = {f.source: f for f in result[-1]}
    assert set(last) == {("n1", "eth0", 3), ("n5", "eth0", 3)}
    for finding in last.values():
        assert [(v.node, v.priority) for v in finding.victims] == [("n2", 3)]
        assert finding.victims[0].rx_pause_rate > 800
        assert finding.victims[0].baseline_rx_pause_rate * 2 <= finding.victims[0].rx_pause_rate
    assert last[("n1", "eth0", 3)].victims[0].baseline_rx_pause_rate == 0


def test_a_port_paused_as_much_before_the_storm_is_no_victim() -> None:
    series = {
        ("n1", "eth0", 3): tx(0, 0, 0, 0, 3000, 3000, 3000),
        ("n2", "eth0", 3): rx(600, 600, 600, 600, 600, 600, 600),
    }
    assert run(series)[-1][0].victims == ()


def test_restoration_after_the_window_is_reported_once() -> None:
    result = run({("n1", "eth0", 3): tx(2000, 2000, 2000, 2000, 0, 0, 0, 0, 0)})
    states = [[f.state for f in r] for r in result]
    storm, restored = ["storm"], ["restored"]
    assert states == [[], storm, storm, storm, storm, storm, restored, [], []]
    finding = result[6][0]
    assert finding.restored_at == at(6)
    assert finding.last_seen == at(3)
    assert finding.evidence["duration_s"] == 4.0


def test_pauses_returning_during_restoration_keep_the_storm_open() -> None:
    result = run({("n1", "eth0", 3): tx(2000, 2000, 2000, 0, 0, 2000, 0, 0, 0, 0)})
    states = [[f.state for f in r] for r in result]
    assert states[5] == ["storm"] and states[7] == ["storm"]
    assert states[8] == ["restored"]


def test_samples_from_counter_rates_reads_canonical_and_sniffer_names() -> None:
    rates = {
        "tx_prio3_pause": 1200.0,
        "tx_prio3_pause_duration": 400_000.0,
        "rx_prio3_pause": None,
        "rx_prio0_pause": 3.0,
        "tx_pause": 7.0,
        "rx_discards_phy": 99.0,
    }
    samples = {s.priority: s for s in samples_from_counter_rates("n1", "eth0", T0, rates)}
    assert set(samples) == {0, 3, None}
    assert samples[3].tx_pause_rate == 1200.0
    assert samples[3].tx_pause_duration_rate == 400_000.0
    assert samples[3].rx_pause_rate is None
    assert samples[0].rx_pause_rate == 3.0
    assert samples[None].tx_pause_rate == 7.0

    [sniffed] = samples_from_counter_rates("n1", "mwpfc-a1", T0, {"pfc_frames_prio3": 950.0})
    assert (sniffed.priority, sniffed.tx_pause_rate) == (3, 950.0)


def test_deadlock_cycle_is_found_and_chains_are_not() -> None:
    edges = [("A", "B"), ("B", "C"), ("C", "A"), ("D", "A"), ("C", "E")]
    assert find_deadlock_cycles(edges) == [["A", "B", "C"]]
    assert find_deadlock_cycles([("A", "B"), ("B", "C"), ("C", "D")]) == []


def test_deadlock_cycles_two_separate_rings_and_a_self_loop() -> None:
    p = [("sw1", f"Ethernet{i}", 3) for i in range(6)]
    edges = [(p[0], p[1]), (p[1], p[0]), (p[2], p[3]), (p[3], p[4]), (p[4], p[2]), (p[5], p[5])]
    cycles = find_deadlock_cycles(edges)
    assert sorted(len(c) for c in cycles) == [1, 2, 3]
    assert [p[2], p[3], p[4]] in cycles
    assert [p[5]] in cycles


def test_deadlock_search_handles_a_long_chain() -> None:
    chain = [(i, i + 1) for i in range(5000)] + [(5000, 0)]
    [cycle] = find_deadlock_cycles(chain)
    assert len(cycle) == 5001
