"""PingmeshLocalizer on synthetic ping-mesh windows: 12 nodes on 3 ToRs, 4 flows a pair.

node-00..03 hang off tor-0, node-04..07 off tor-1, node-08..11 off tor-2; every node
probes every other (the pinglist's cross-ToR budget covers the whole cluster).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

import pytest

from app.analysis.pingmesh import (
    Finding,
    LocalizerConfig,
    PairStat,
    PingmeshLocalizer,
    benchmark_localizer,
    synthetic_window,
)
from app.analysis.topology import Topology, pinglist_for

START = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
LossRule = Callable[[str, str, int], bool]


@pytest.fixture
def topology() -> Topology:
    return Topology.synthetic(nodes=12, tors=3)


@pytest.fixture
def pinglists(topology: Topology) -> dict[str, list[str]]:
    return {n: pinglist_for(topology, n, cross_tor_peers=8) for n in topology.nodes}


class Clock:
    """Drives one localizer second by second, as the engine's 1 Hz cycle does."""

    def __init__(self, topology: Topology, pinglists: dict[str, list[str]]) -> None:
        self.topology = topology
        self.pinglists = pinglists
        self.localizer = PingmeshLocalizer()
        self.now = START

    def run(
        self,
        seconds: int,
        lost: LossRule | None = None,
        silent: Iterable[str] = (),
        rtt_extra_us: Callable[[str, str], float] | None = None,
        edit: Callable[[datetime, list[PairStat]], list[PairStat]] | None = None,
    ) -> list[list[Finding]]:
        """Evaluate ``seconds`` windows; return the findings of each evaluation."""
        results = []
        for _ in range(seconds):
            self.now += timedelta(seconds=1)
            window = synthetic_window(
                self.topology,
                self.pinglists,
                self.now,
                lost=lost,
                silent=silent,
                rtt_extra_us=rtt_extra_us,
            )
            if edit is not None:
                window = edit(self.now, window)
            results.append(self.localizer.evaluate(self.topology, window, self.now))
        return results


def keys(findings: list[Finding]) -> set[str]:
    return {f.key for f in findings}


def test_node_down_is_named_first_and_closes_when_healthy(topology, pinglists):
    clock = Clock(topology, pinglists)
    assert clock.run(6) == [[]] * 6

    dead = "node-05"
    results = clock.run(3, lost=lambda s, d, f: dead in (s, d))

    for findings in results:
        assert [f.key for f in findings] == [f"node-unreachable:node:{dead}"]
    finding = results[-1][0]
    assert finding.kind == "node-unreachable"
    assert (finding.top.type, finding.top.id, finding.top.score) == ("node", dead, 1.0)
    # The ToR it hangs off is a weaker suspect: its other pairs are healthy.
    tor_suspect = next(s for s in finding.suspects if s.type == "tor")
    assert tor_suspect.id == "tor-1" and tor_suspect.score < 0.5
    # Both directions, with peers on every ToR, are the evidence.
    assert finding.failing_pairs == 22
    peers = {e.dst if e.src == dead else e.src for e in finding.evidence}
    assert {topology.tor_of(p) for p in peers} == {"tor-0", "tor-1", "tor-2"}
    assert all(e.received == 0 and e.sent == 16 for e in finding.evidence)
    # Identity is stable, so the caller updates one incident rather than opening three.
    assert {r[0].first_seen for r in results} == {results[0][0].first_seen}

    assert clock.run(1) == [[]]


def test_dead_node_that_reports_nothing_is_found_from_its_peers_probes(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)
    dead = "node-02"

    def add_stale_rows_of_dead_node(now: datetime, window: list[PairStat]) -> list[PairStat]:
        # Its last healthy rows, from before it died, are still inside the window.
        before = now - timedelta(seconds=4)
        return window + [
            PairStat(dead, peer, 49152, 4, 4, 30.0, before) for peer in pinglists[dead]
        ]

    [findings] = clock.run(
        1,
        lost=lambda s, d, f: d == dead,
        silent=[dead],
        edit=add_stale_rows_of_dead_node,
    )
    assert keys(findings) == {f"node-unreachable:node:{dead}"}
    finding = findings[0]
    # Its stale outgoing rows are neither healthy pairs through it nor evidence.
    assert finding.healthy_pairs == 0
    assert finding.top.score == 1.0
    assert finding.failing_pairs == 11
    assert all(e.dst == dead for e in finding.evidence)


def test_silent_node_with_healthy_fabric_is_not_blamed(topology, pinglists):
    # An agent that stopped reporting while its responder still answers: no fault to name.
    clock = Clock(topology, pinglists)
    results = clock.run(8, silent=["node-09"])
    assert results == [[]] * 8


def test_tor_down(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)
    on_tor = set(topology.nodes_on("tor-1"))
    [findings] = clock.run(1, lost=lambda s, d, f: s in on_tor or d in on_tor)
    assert keys(findings) == {"tor-down:tor:tor-1"}
    finding = findings[0]
    assert finding.top.score == 1.0
    # Intra-ToR pairs (4 x 3) and cross pairs (4 x 8 x 2) all fail.
    assert finding.failing_pairs == 12 + 64
    assert any(topology.tor_of(e.src) == topology.tor_of(e.dst) for e in finding.evidence)


def test_uplink_down_keeps_intra_tor_pairs_healthy(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)
    on_tor = set(topology.nodes_on("tor-2"))

    def cross_tor2(s: str, d: str, f: int) -> bool:
        return (s in on_tor) != (d in on_tor)

    [findings] = clock.run(1, lost=cross_tor2)
    assert keys(findings) == {"uplink-down:uplink:tor-2"}
    finding = findings[0]
    assert finding.failing_pairs == 64
    # The ToR itself is a lesser suspect: its 12 intra-ToR pairs are healthy.
    tor = next(s for s in finding.suspects if s.type == "tor")
    assert tor.id == "tor-2" and tor.score < finding.top.score


def test_ecmp_path_partial_flow_loss_is_path_loss_after_it_persists(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)

    def two_flows(s: str, d: str, f: int) -> bool:
        return (s, d) == ("node-01", "node-06") and f in (0, 1)

    cfg = LocalizerConfig()
    persisting = int(cfg.path_confirm_s)
    results = clock.run(persisting + 2, lost=two_flows)
    # Not before it has outlasted a window: one burst of loss must not open anything.
    assert results[: persisting] == [[]] * persisting
    findings = results[-1]
    assert keys(findings) == {"path-loss:path:node-01|node-06"}
    evidence = findings[0].evidence
    assert len(evidence) == 1
    assert (evidence[0].flows, evidence[0].lossy_flows) == (4, 2)
    assert (evidence[0].sent, evidence[0].received) == (16, 8)
    assert findings[0].first_seen == START + timedelta(seconds=7)


def test_two_simultaneous_faults_are_both_named(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)
    dead = "node-02"  # on tor-0
    on_tor2 = set(topology.nodes_on("tor-2"))

    def faults(s: str, d: str, f: int) -> bool:
        return dead in (s, d) or (s in on_tor2) != (d in on_tor2)

    [findings] = clock.run(1, lost=faults, silent=[dead])
    assert keys(findings) == {"uplink-down:uplink:tor-2", f"node-unreachable:node:{dead}"}


def test_occasional_probe_loss_on_a_healthy_fabric_opens_nothing():
    # As the engine does: per-second rows, each window the sum of the last 4 seconds,
    # so a lost probe stays in 4 consecutive windows.
    topology = Topology.synthetic(nodes=24, tors=3)
    pinglists = {n: pinglist_for(topology, n, cross_tor_peers=16) for n in topology.nodes}
    localizer = PingmeshLocalizer()
    rng = random.Random(20240501)
    window_s = int(localizer.config.window_s)
    seconds: deque[list[PairStat]] = deque(maxlen=window_s)
    now = START
    lost_probes = 0
    lossy_windows = 0
    for _ in range(240):
        now += timedelta(seconds=1)
        second = synthetic_window(
            topology, pinglists, now, probes_per_flow=1, rng=rng, noise_loss=0.005
        )
        lost_probes += sum(row.sent - row.received for row in second)
        seconds.append(second)
        window = sum_window(seconds)
        lossy_windows += any(row.sent - row.received >= 2 for row in window)
        assert localizer.evaluate(topology, window, now) == []
    # 24 x 23 pairs x 4 flows x 240 s at 0.5 %: the noise really was there, with
    # windows where one flow lost two probes.
    assert lost_probes > 1000
    assert lossy_windows > 0


def sum_window(seconds: Iterable[list[PairStat]]) -> list[PairStat]:
    """Sum per-second rows into one row per (src, dst, flow), as the engine's query does."""
    summed: dict[tuple[str, str, int], list] = {}
    for second in seconds:
        for src, dst, flow, sent, received, rtt, ts in second:
            acc = summed.get((src, dst, flow))
            if acc is None:
                summed[(src, dst, flow)] = [sent, received, rtt, ts]
            else:
                acc[0] += sent
                acc[1] += received
                acc[2] = rtt if rtt is not None else acc[2]
                acc[3] = max(acc[3], ts)
    return [PairStat(*key, *acc) for key, acc in summed.items()]


def test_a_few_dead_paths_through_a_node_do_not_blame_the_node(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)
    dead_pairs = {("node-00", p) for p in ("node-01", "node-04", "node-06", "node-08", "node-10")}
    results = clock.run(8, lost=lambda s, d, f: (s, d) in dead_pairs)
    # 5 of node-00's 22 pairs fail: the other 17 say its NIC works.
    assert keys(results[-1]) == {f"path-loss:path:{s}|{d}" for s, d in dead_pairs}


def test_one_lost_probe_in_one_second_is_noise(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)

    def lose_one_probe(now: datetime, window: list[PairStat]) -> list[PairStat]:
        return [
            row._replace(received=row.sent - 1)
            if (row.src, row.dst, row.flow) == ("node-00", "node-04", 49152)
            else row
            for row in window
        ]

    # The same lost probe stays in every window that covers its second, and beyond.
    assert clock.run(10, edit=lose_one_probe) == [[]] * 10


def test_one_dead_flow_of_one_pair_opens_only_after_persisting(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(6)
    results = clock.run(8, lost=lambda s, d, f: (s, d, f) == ("node-00", "node-04", 3))
    # 4 of 16 probes a window on one pair is real loss, but one pair alone needs time.
    confirm = int(LocalizerConfig().path_confirm_s)
    assert results[:confirm] == [[]] * confirm
    assert keys(results[-1]) == {"path-loss:path:node-00|node-04"}


def test_latency_degradation_of_one_nodes_link(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(10)
    slow = "node-07"

    def slow_link(s: str, d: str) -> float:
        return 400.0 if slow in (s, d) else 0.0

    cfg = LocalizerConfig()
    results = clock.run(int(cfg.latency_confirm_s) + 1, rtt_extra_us=slow_link)
    assert results[0] == []
    findings = results[-1]
    assert keys(findings) == {f"latency-degradation:node:{slow}"}
    finding = findings[0]
    assert finding.failing_pairs == 22
    for e in finding.evidence:
        assert e.baseline_us is not None and 25 < e.baseline_us < 35
        assert e.rtt_p50_us is not None and e.rtt_p50_us > 400
    # Degraded windows do not drag the baseline up, so the finding does not fade.
    assert clock.localizer.baseline_us("node-00", slow) < 35
    assert keys(clock.run(5, rtt_extra_us=slow_link)[-1]) == {
        f"latency-degradation:node:{slow}"
    }
    assert clock.run(1) == [[]]


def test_small_rtt_rise_below_the_floor_is_not_degradation(topology, pinglists):
    clock = Clock(topology, pinglists)
    clock.run(10)
    # 30 us -> 90 us triples the RTT but stays under the 100 us absolute floor.
    results = clock.run(6, rtt_extra_us=lambda s, d: 60.0 if "node-03" in (s, d) else 0.0)
    assert results == [[]] * 6


def test_benchmark_runs_and_finds_the_dead_tor():
    result = benchmark_localizer(nodes=60, tors=5, peers=16, evaluations=2)
    assert result["rows"] == 60 * 16 * 4
    assert result["tor_down_top"] == "tor-down:tor:tor-4"


@pytest.mark.parametrize(("lost", "flagged"), [(1, False), (2, False), (3, False), (4, True)])
def test_pair_is_lossy_only_when_loss_is_unlikely_under_background(
    topology, pinglists, lost, flagged
):
    # With confirmation off, what one window says about one pair is visible directly:
    # at 1 % background loss, 3 of 16 lost probes happen; 4 of 16 do not (p < 1e-4).
    localizer = PingmeshLocalizer(LocalizerConfig(path_confirm_s=0, latency_confirm_s=0))
    window = synthetic_window(topology, pinglists, START)
    window = [
        row._replace(received=row.sent - lost)
        if (row.src, row.dst, row.flow) == ("node-03", "node-11", 49152)
        else row
        for row in window
    ]
    findings = localizer.evaluate(topology, window, START)
    assert keys(findings) == ({"path-loss:path:node-03|node-11"} if flagged else set())
