"""Bisection for slow nodes, driven against simulated fleets."""

from __future__ import annotations

import json
import math

import pytest

from app.analysis.bisect import (
    BisectionState,
    advance,
    expire_round,
    group_figure,
    next_groups,
    record,
    ring_hops,
    simulate,
    start,
)

BENCHMARKS = ["gemm", "net-ring"]


def fleet(n: int, slow: dict[int, float] | None = None, healthy: float = 100.0) -> dict[str, float]:
    figures = {f"node{i:03d}": healthy for i in range(n)}
    for i, figure in (slow or {}).items():
        figures[f"node{i:03d}"] = figure
    return figures


def all_groups(state: BisectionState) -> list[list[str]]:
    return [g.members for r in state.rounds for g in r.groups]


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_one_slow_node_in_16_is_named_within_four_rounds_after_baseline(benchmark: str) -> None:
    state = simulate(fleet(16, {9: 70.0}), benchmark, 0.15)

    assert state.done
    assert state.verdict is not None
    assert state.verdict.outcome == "slow"
    assert list(state.verdict.slow_nodes) == ["node009"]
    assert state.verdict.slow_nodes["node009"]["ratio"] == pytest.approx(0.7)
    assert state.rounds[0].kind == "baseline"
    assert state.rounds_after_baseline <= 4
    assert state.suspects == {"node009"}


@pytest.mark.parametrize("benchmark", BENCHMARKS)
@pytest.mark.parametrize("groups", [1, 2, 3, 8])
def test_one_slow_node_takes_at_most_log2_n_rounds_for_every_position(
    benchmark: str, groups: int
) -> None:
    # A trusted baseline lets even one or two baseline groups work, the deepest bisection.
    for n in (6, 7, 12, 13, 16, 31, 33, 64, 100):
        for position in range(n):
            state = simulate(
                fleet(n, {position: 50.0}), benchmark, 0.15, baseline=100.0, baseline_groups=groups
            )
            assert state.verdict is not None
            assert list(state.verdict.slow_nodes) == [f"node{position:03d}"], (n, position)
            assert state.rounds_after_baseline <= math.ceil(math.log2(n)), (n, position)


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_two_slow_nodes_in_16_are_both_found(benchmark: str) -> None:
    # Adjacent and far apart, in the same baseline group and in different ones.
    for slow in ({3: 60.0, 12: 80.0}, {4: 60.0, 5: 75.0}, {0: 50.0, 15: 50.0}):
        state = simulate(fleet(16, slow), benchmark, 0.15, baseline_groups=4)
        assert state.verdict is not None
        assert sorted(state.verdict.slow_nodes) == sorted(f"node{i:03d}" for i in slow)
        assert state.verdict.outcome == "slow"
        assert not state.verdict.failed_nodes


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_healthy_fleet_is_declared_healthy_after_the_baseline_round(benchmark: str) -> None:
    # Small noise, well inside the threshold.
    figures = {f"n{i}": 100.0 + (i % 5) - 2 for i in range(16)}
    state = simulate(figures, benchmark, 0.15)

    assert state.verdict is not None
    assert state.verdict.outcome == "healthy"
    assert len(state.rounds) == 1
    assert state.suspects == set()
    assert state.baseline == pytest.approx(100.0, abs=2)


@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_node_that_never_answers_is_named_as_failed_suspect(benchmark: str) -> None:
    state = simulate(fleet(16), benchmark, 0.15, fail_nodes=["node006"])

    assert state.verdict is not None
    assert state.verdict.outcome == "failed"
    assert list(state.verdict.failed_nodes) == ["node006"]
    assert not state.verdict.slow_nodes
    assert "node006" in state.verdict.reason and "did not answer" in state.verdict.reason
    assert state.suspects == {"node006"}


def test_failed_and_slow_nodes_are_reported_together() -> None:
    state = simulate(fleet(16, {2: 60.0}), "net-ring", 0.15, fail_nodes=["node013"])

    assert state.verdict is not None
    assert state.verdict.outcome == "slow"
    assert list(state.verdict.slow_nodes) == ["node002"]
    assert list(state.verdict.failed_nodes) == ["node013"]


def test_lower_is_better_latencies() -> None:
    latencies = {f"n{i}": 10.0 for i in range(16)}
    latencies["n7"] = 14.0
    state = simulate(latencies, "gemm", 0.15, higher_is_better=False)

    assert state.verdict is not None
    assert list(state.verdict.slow_nodes) == ["n7"]
    # A faster-than-usual node is not slow.
    latencies["n7"] = 5.0
    assert simulate(latencies, "gemm", 0.15, higher_is_better=False).verdict.outcome == "healthy"


@pytest.mark.parametrize("n", [12, 13])
@pytest.mark.parametrize("benchmark", BENCHMARKS)
def test_fleet_size_not_a_power_of_two(n: int, benchmark: str) -> None:
    for slow in ({n - 1: 60.0}, {0: 60.0, n // 2: 70.0}):
        state = simulate(fleet(n, slow), benchmark, 0.15, baseline_groups=4)
        assert state.verdict is not None
        assert sorted(state.verdict.slow_nodes) == sorted(f"node{i:03d}" for i in slow)
        # Every node was in exactly one baseline group.
        baseline_members = [m for g in state.rounds[0].groups for m in g.members]
        assert sorted(baseline_members) == sorted(fleet(n))


def test_ring_singletons_are_paired_with_a_known_good_node() -> None:
    state = simulate(fleet(16, {5: 60.0}), "net-ring", 0.15)

    good = {f"node{i:03d}" for i in range(16)} - {"node005"}
    for r in state.rounds:
        for g in r.groups:
            assert len(g.members) >= 2  # a ring never runs alone
            if len(g.subjects) == 1:
                partners = set(g.members) - set(g.subjects)
                assert partners and partners <= good
            # Groups of one round never share a node: each node runs one benchmark at a time.
        members = [m for g in r.groups for m in g.members]
        assert len(members) == len(set(members))
    assert ring_hops(["a", "b", "c"]) == [("a", "b"), ("b", "c"), ("c", "a")]


def test_gemm_singletons_run_alone() -> None:
    state = simulate(fleet(16, {5: 60.0}), "gemm", 0.15)
    last = state.rounds[-1]
    assert [g.members for g in last.groups] == [["node004"], ["node005"]]


def test_json_round_trip_mid_bisection_then_continue_gives_the_same_verdict() -> None:
    figures = fleet(16, {3: 60.0, 10: 75.0})
    silent = {"node014"}
    expected = simulate(figures, "net-ring", 0.15, fail_nodes=silent)

    state = start(list(figures), "net-ring", 0.15)
    restarts = 0
    while not state.done:
        groups = next_groups(state)
        # Answer half the round, "crash", reload from JSON, answer the rest.
        for i, members in enumerate(groups):
            if i == len(groups) // 2:
                state = BisectionState.from_json(json.loads(json.dumps(state.to_json())))
                restarts += 1
            figure = None if silent & set(members) else min(figures[m] for m in members)
            record(state, members, figure)
        state = BisectionState.from_json(json.loads(json.dumps(state.to_json())))
        advance(state)

    assert restarts >= 2
    assert state.verdict is not None and expected.verdict is not None
    assert state.verdict.to_json() == expected.verdict.to_json()
    assert sorted(state.verdict.slow_nodes) == ["node003", "node010"]
    assert list(state.verdict.failed_nodes) == ["node014"]
    assert state.to_json() == BisectionState.from_json(state.to_json()).to_json()


def test_advance_waits_for_the_whole_round_and_record_is_idempotent() -> None:
    state = start([f"n{i}" for i in range(8)], "gemm", 0.2, baseline_groups=4)
    groups = next_groups(state)
    assert groups == [["n0", "n1"], ["n2", "n3"], ["n4", "n5"], ["n6", "n7"]]

    record(state, groups[0], 100.0)
    assert advance(state) is False
    record(state, groups[0], 100.0)  # a retried request changes nothing
    with pytest.raises(ValueError):
        record(state, groups[0], 50.0)
    with pytest.raises(ValueError):
        record(state, ["n0", "n2"], 100.0)  # not a group of this round
    assert next_groups(state) == groups[1:]

    record(state, groups[1], 100.0)
    record(state, groups[2], 50.0)
    # The deadline passes without an answer from n6/n7.
    expire_round(state)
    assert advance(state) is True
    assert state.baseline == 100.0
    assert [g.status for g in state.rounds[0].groups] == ["ok", "ok", "slow", "failed"]
    assert next_groups(state) == [["n4"], ["n5"], ["n6"], ["n7"]]
    assert state.suspects == {"n4", "n5", "n6", "n7"}


def test_slow_group_whose_halves_are_fine_is_inconclusive() -> None:
    # The slowness belongs to the pair, not to either node (a bad link between them).
    state = start([f"n{i}" for i in range(8)], "gemm", 0.15, baseline_groups=4)
    for members in next_groups(state):
        record(state, members, 60.0 if members == ["n2", "n3"] else 100.0)
    advance(state)
    for members in next_groups(state):
        record(state, members, 100.0)
    advance(state)

    assert state.done and state.verdict is not None
    assert state.verdict.outcome == "inconclusive"
    assert state.verdict.unresolved[0]["nodes"] == ["n2", "n3"]
    assert "each half" in state.verdict.reason


def test_baseline_comes_from_the_healthy_groups_even_when_most_hold_a_slow_node() -> None:
    # 5 of 8 groups hold a slow node, each slow by a different amount.
    slow = {0: 60.0, 3: 40.0, 5: 70.0, 9: 50.0, 13: 30.0}
    state = simulate(fleet(16, slow), "gemm", 0.15)
    assert state.baseline == 100.0
    assert state.verdict is not None
    assert sorted(state.verdict.slow_nodes) == sorted(f"node{i:03d}" for i in slow)


def test_baseline_ignores_an_unconfirmed_glitch_but_says_so() -> None:
    figures = fleet(16)
    figures["node004"] = figures["node005"] = 400.0  # one group reads 4x: a glitch
    state = simulate(figures, "gemm", 0.15)
    assert state.baseline == 100.0
    assert state.verdict is not None
    assert state.verdict.outcome == "inconclusive"
    assert state.verdict.unresolved[0]["nodes"] == ["node004", "node005"]
    assert not state.verdict.slow_nodes


def test_no_two_baseline_groups_agree_is_inconclusive() -> None:
    state = simulate(fleet(6, {0: 30.0, 2: 60.0}), "gemm", 0.15, baseline_groups=3)
    assert state.verdict is not None
    assert state.verdict.outcome == "inconclusive"
    assert "agree" in state.verdict.reason


def test_too_small_fleet_without_reference_is_inconclusive() -> None:
    state = start(["a", "b", "c", "d"], "net-ring", 0.15)
    assert state.done and state.verdict is not None
    assert state.verdict.outcome == "inconclusive"
    assert "baseline" in state.verdict.reason
    assert next_groups(state) == []

    # With a known healthy figure the same fleet can be bisected.
    state = simulate({"a": 10.0, "b": 10.0, "c": 4.0, "d": 10.0}, "net-ring", 0.15, baseline=10.0)
    assert state.verdict is not None and list(state.verdict.slow_nodes) == ["c"]


def test_group_figure_is_the_worst_part() -> None:
    assert group_figure([90.0, 40.0, 100.0]) == 40.0
    assert group_figure([9.0, 14.0], higher_is_better=False) == 14.0
    assert group_figure([90.0, None]) is None


def test_invalid_input_is_refused() -> None:
    with pytest.raises(ValueError):
        start(["a", "a", "b"], "gemm", 0.15)
    with pytest.raises(ValueError):
        start(["a", "b", "c"], "gemm", 1.5)
    state = start(["a", "b", "c"], "gemm", 0.15)
    with pytest.raises(ValueError):
        record(state, ["a"], float("nan"))
