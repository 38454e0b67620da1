"""Passive straggler detection on per-rank step times."""

from __future__ import annotations

import json
import random
from dataclasses import asdict

from app.analysis.stragglers import (
    THROTTLE_HW_SLOWDOWN,
    THROTTLE_HW_THERMAL,
    THROTTLE_SW_POWER_CAP,
    StragglerConfig,
    StragglerDetector,
)

T0 = 1_700_000_000.0
STEP_S = 2.0  # one training step every two seconds
RANKS_PER_NODE = 8
NODES = [f"gpu{i:02d}" for i in range(8)]  # 64 ranks


def node_of(rank: int) -> str:
    return NODES[rank // RANKS_PER_NODE]


def feed(
    detector: StragglerDetector,
    steps: range,
    slow: dict[int, float] | None = None,
    slow_steps: set[int] | None = None,
    noise: float = 0.02,
    seed: int = 1,
    job: str = "llama-70b",
) -> float:
    """Report ``steps`` for every rank; ``slow`` maps rank -> slowdown factor. Returns last ts."""
    rng = random.Random(seed)
    ts = T0
    for step in steps:
        ts = T0 + step * STEP_S
        for rank in range(len(NODES) * RANKS_PER_NODE):
            duration = 1.5 * (1 + rng.gauss(0, noise))
            if slow and rank in slow and (slow_steps is None or step in slow_steps):
                duration *= slow[rank]
            detector.observe_step(job, rank, node_of(rank), step, duration, ts)
    return ts


def test_uniform_fleet_with_noise_is_never_flagged() -> None:
    detector = StragglerDetector()
    for seed in range(5):
        last = feed(detector, range(seed * 100, seed * 100 + 100), seed=seed)
        assert detector.evaluate(last) == []


def test_perfectly_uniform_fleet_with_zero_mad_is_not_flagged() -> None:
    # Every rank identical but one a hair slower: its z is huge, its slowdown is not.
    detector = StragglerDetector()
    for step in range(60):
        for rank in range(32):
            duration = 1.5 * (1.01 if rank == 7 else 1.0)
            detector.observe_step("j", rank, node_of(rank), step, duration, T0 + step * STEP_S)
    assert detector.evaluate(T0 + 60 * STEP_S) == []


def test_one_rank_30_percent_slow_persistently_is_flagged_with_its_node() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={42: 1.3})

    findings = detector.evaluate(last)

    assert len(findings) == 1
    finding = findings[0]
    assert finding.job == "llama-70b"
    assert finding.node == node_of(42) == "gpu05"
    assert finding.ranks == [42]
    assert 0.25 < finding.slowdown < 0.35
    assert finding.z > 3.5
    assert finding.first_seen <= last - StragglerConfig().min_duration_s
    assert finding.evidence["steps_slow"]["42"] >= 0.8 * finding.evidence["steps_evaluated"]
    assert not finding.corroborated  # no GPU or RTT data was reported
    json.dumps(asdict(finding))  # findings go to the database as JSON


def test_slow_ranks_on_one_node_are_grouped() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={16: 1.25, 17: 1.25, 40: 1.4})
    findings = {f.node: f for f in detector.evaluate(last)}
    assert set(findings) == {"gpu02", "gpu05"}
    assert findings["gpu02"].ranks == [16, 17]
    assert findings["gpu05"].ranks == [40]


def test_a_single_slow_step_is_not_an_incident() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={42: 3.0}, slow_steps={50})
    assert detector.evaluate(last) == []


def test_slow_but_not_for_long_enough_is_not_yet_an_incident() -> None:
    config = StragglerConfig(min_duration_s=60.0)
    detector = StragglerDetector(config)
    # Slow from step 40: at step 59 it has been slow for 38 s.
    last = feed(detector, range(60), slow={3: 1.3}, slow_steps=set(range(40, 200)))
    assert detector.evaluate(last) == []
    # Keep going: past 60 s it becomes an incident, dated from its first slow step.
    last = feed(detector, range(60, 80), slow={3: 1.3}, slow_steps=set(range(40, 200)))
    (finding,) = detector.evaluate(last)
    assert finding.ranks == [3]
    assert finding.first_seen == T0 + 40 * STEP_S


def test_intermittent_slowness_below_persistence_is_not_flagged() -> None:
    detector = StragglerDetector()
    # Slow every other step: 50 % of the window, under the 80 % persistence.
    last = feed(detector, range(80), slow={9: 1.5}, slow_steps=set(range(0, 80, 2)))
    assert detector.evaluate(last) == []


def test_recovered_rank_is_no_longer_flagged() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={5: 1.3})
    assert [f.ranks for f in detector.evaluate(last)] == [[5]]
    last = feed(detector, range(60, 90))
    assert detector.evaluate(last) == []


def test_throttled_node_is_corroborated() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={42: 1.3, 3: 1.3})
    for node in NODES:
        for gpu in range(RANKS_PER_NODE):
            slowed = node == "gpu05" and gpu == 2
            detector.observe_gpu(
                node,
                last - 5,
                sm_clock_mhz=1410.0 if slowed else 1980.0,
                throttle_reasons=(THROTTLE_HW_SLOWDOWN | THROTTLE_HW_THERMAL)
                if slowed
                else THROTTLE_SW_POWER_CAP,  # routine under load: not a hint on its own
                gpu=gpu,
            )

    findings = {f.node: f for f in detector.evaluate(last)}

    throttled = findings["gpu05"]
    assert throttled.corroborated
    assert throttled.evidence["throttle_names"] == ["sw_power_cap", "hw_slowdown", "hw_thermal"]
    assert any("hw_slowdown" in h for h in throttled.evidence["hints"])
    assert any("SM clock 1410" in h for h in throttled.evidence["hints"])
    assert throttled.evidence["fleet_sm_clock_mhz"] == 1980.0
    # The other straggler's GPUs only power-cap like everyone's: no corroboration.
    assert not findings["gpu00"].corroborated
    assert findings["gpu00"].evidence["throttle_names"] == ["sw_power_cap"]


def test_high_rtt_node_is_corroborated() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={42: 1.3})
    for node in NODES:
        for second in range(10):
            detector.observe_rtt(node, last - second, 900.0 if node == "gpu05" else 25.0)
    (finding,) = detector.evaluate(last)
    assert finding.corroborated
    assert finding.evidence["rtt_p50_us"] == 900.0
    assert "RTT 900" in finding.evidence["hints"][0]


def test_old_hints_and_silent_jobs_are_forgotten() -> None:
    detector = StragglerDetector()
    last = feed(detector, range(60), slow={42: 1.3})
    detector.observe_gpu("gpu05", last - 1000, 1000.0, THROTTLE_HW_SLOWDOWN)
    (finding,) = detector.evaluate(last)
    assert not finding.corroborated  # a throttle a quarter of an hour ago says nothing now
    assert detector.evaluate(last + 3600) == []  # the job stopped reporting
