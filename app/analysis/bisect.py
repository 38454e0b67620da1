"""Active bisection: find slow nodes by benchmarking groups (adaptive group testing).

A passive detector can say "this job got slow"; bisection says which node. The
backend runs a benchmark on groups of nodes, compares each group's figure with
a baseline, and keeps halving the groups that are slow until single nodes are
left. Everything here is pure: a serialisable :class:`BisectionState` and
functions that move it on. The API layer stores the state as JSON, hands
:func:`next_groups` to the agents, feeds their answers to :func:`record` and
calls :func:`advance`; a restart between any two calls loses nothing.

Group figures
-------------
Group testing works when a group is slow if and only if at least one member
is slow, so a group's figure must be its worst part:

* ``gemm`` (a per-node figure): every member runs the benchmark on its own
  GPUs and the group figure is the worst member figure (:func:`group_figure`,
  the minimum for throughputs, the maximum for latencies).
* ``net-ring`` (and ``nccl*`` collectives): the members form a ring in the
  listed order (:func:`ring_hops`), each receiver measures its hop, and the
  group figure is the slowest hop. A slow NIC slows both hops it sits on, so
  the ring shows it. A ring needs two nodes: a single suspect is paired with
  a node already known to be good (a member of a group that was within
  threshold), so the pair's figure reflects the suspect. Such a group lists
  both nodes in ``members`` and only the suspect in ``subjects``.

Baseline
--------
Round 0 splits the fleet (in the order given, normally sorted by rack) into
up to ``baseline_groups`` (default 8) disjoint groups of near-equal size that
all run at once. Since a group's figure is its worst part, slow nodes only
pull figures down, and no group beats the healthy figure by more than noise.
So the baseline is taken from the top: the best figure that at least one
other group confirms (is within ``threshold`` of it), and the median of the
groups so confirmed. A plain median of all groups would not do: with large
groups, two or three slow nodes already sit in half of them. The estimate
holds while at least two baseline groups are healthy; a lone reading far
above the rest is left out as unconfirmed and listed as unresolved. A caller
that knows the healthy figure (from the hardware spec or a previous run)
passes ``baseline=`` instead, which is also the only way to test fewer than
three groups. Bisect one pool of identical hardware at a time: a faster pool
would make a healthy slower one look slow.

The baseline round is also the first screening: its slow groups are the
first to be halved, so one slow node among N is named at most
``ceil(log2(ceil(N / groups)))`` rounds after the baseline, never more than
``ceil(log2 N)``. Groups of a round run at once, so more baseline groups
mean fewer rounds; the default of 8 bounds how many benchmark jobs start
together.

A group is slow when its figure is worse than the baseline by more than
``threshold`` (a fraction: 0.15 means 15 %). A group whose member did not
answer before the deadline (figure ``None``) failed: it is halved like a slow
group, and a single node that fails is named in the verdict as not answering.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

STATE_VERSION = 1
DEFAULT_BASELINE_GROUPS = 8
MIN_BASELINE_GROUPS = 3  # a median of fewer groups is not robust to one slow group

GroupStatus = Literal["pending", "measured", "ok", "slow", "failed"]
Outcome = Literal["slow", "failed", "healthy", "inconclusive"]


def needs_peers(benchmark: str) -> bool:
    """Whether a benchmark runs across nodes (a ring), so a group needs two members."""
    return benchmark == "net-ring" or benchmark.startswith("nccl")


def ring_hops(members: Sequence[str]) -> list[tuple[str, str]]:
    """The (sender, receiver) hops of a ring over ``members`` in their listed order."""
    if len(members) < 2:
        return []
    return [(members[i], members[(i + 1) % len(members)]) for i in range(len(members))]


def group_figure(figures: Iterable[float | None], higher_is_better: bool = True) -> float | None:
    """A group's figure from its members' (gemm) or hops' (ring) figures: the worst one.

    ``None`` when any part is missing: the group failed.
    """
    values = list(figures)
    if not values or any(v is None for v in values):
        return None
    numbers = [float(v) for v in values if v is not None]
    return min(numbers) if higher_is_better else max(numbers)


@dataclass
class BisectionGroup:
    """One benchmark run: who runs it, whose health it decides, and what it measured."""

    id: str
    members: list[str]
    subjects: list[str]
    parent: str | None = None
    figure: float | None = None
    status: GroupStatus = "pending"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "members": list(self.members),
            "subjects": list(self.subjects),
            "parent": self.parent,
            "figure": self.figure,
            "status": self.status,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BisectionGroup:
        return cls(
            id=str(data["id"]),
            members=[str(n) for n in data["members"]],
            subjects=[str(n) for n in data["subjects"]],
            parent=data.get("parent"),
            figure=None if data.get("figure") is None else float(data["figure"]),
            status=data.get("status", "pending"),
        )


@dataclass
class BisectionRound:
    """Groups that run at the same time; their members are disjoint."""

    index: int
    kind: Literal["baseline", "bisect"]
    groups: list[BisectionGroup]

    @property
    def complete(self) -> bool:
        return all(g.status != "pending" for g in self.groups)

    def to_json(self) -> dict[str, Any]:
        groups = [g.to_json() for g in self.groups]
        return {"index": self.index, "kind": self.kind, "groups": groups}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BisectionRound:
        return cls(
            index=int(data["index"]),
            kind=data["kind"],
            groups=[BisectionGroup.from_json(g) for g in data["groups"]],
        )


@dataclass
class BisectionVerdict:
    """What the bisection concluded, with the evidence for each named node.

    ``outcome`` is ``slow`` when at least one node was measured slow (nodes
    that did not answer are listed too), ``failed`` when the only suspects
    are nodes that did not answer, ``healthy`` when every group was within
    threshold, and ``inconclusive`` when something could not be decided
    (``reason`` says what).
    """

    outcome: Outcome
    slow_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    unresolved: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "slow_nodes": {n: dict(e) for n, e in self.slow_nodes.items()},
            "failed_nodes": {n: dict(e) for n, e in self.failed_nodes.items()},
            "unresolved": [dict(u) for u in self.unresolved],
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BisectionVerdict:
        return cls(
            outcome=data["outcome"],
            slow_nodes={str(n): dict(e) for n, e in data.get("slow_nodes", {}).items()},
            failed_nodes={str(n): dict(e) for n, e in data.get("failed_nodes", {}).items()},
            unresolved=[dict(u) for u in data.get("unresolved", [])],
            reason=str(data.get("reason", "")),
        )


@dataclass
class BisectionState:
    """The whole state of one bisection; ``to_json``/``from_json`` round-trip it exactly."""

    nodes: list[str]
    benchmark: str
    threshold: float
    higher_is_better: bool = True
    peers_required: bool = False
    reference: float | None = None  # a baseline the caller trusts; None: measure it
    baseline: float | None = None
    rounds: list[BisectionRound] = field(default_factory=list)
    suspects: set[str] = field(default_factory=set)
    cleared: set[str] = field(default_factory=set)  # known good: may partner a ring suspect
    # Sets still to test, each {"subjects": [...], "parent": group id}: filled by
    # advance() and drained by the next round (a ring singleton waits longer
    # when every known-good partner is busy).
    waiting: list[dict[str, Any]] = field(default_factory=list)
    slow_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    failed_nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    unresolved: list[dict[str, Any]] = field(default_factory=list)
    verdict: BisectionVerdict | None = None
    done: bool = False

    @property
    def current_round(self) -> BisectionRound | None:
        return self.rounds[-1] if self.rounds else None

    @property
    def rounds_after_baseline(self) -> int:
        return max(0, len(self.rounds) - 1)

    def to_json(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "nodes": list(self.nodes),
            "benchmark": self.benchmark,
            "threshold": self.threshold,
            "higher_is_better": self.higher_is_better,
            "peers_required": self.peers_required,
            "reference": self.reference,
            "baseline": self.baseline,
            "rounds": [r.to_json() for r in self.rounds],
            "suspects": sorted(self.suspects),
            "cleared": sorted(self.cleared),
            "waiting": [
                {"subjects": list(w["subjects"]), "parent": w["parent"]} for w in self.waiting
            ],
            "slow_nodes": {n: dict(e) for n, e in self.slow_nodes.items()},
            "failed_nodes": {n: dict(e) for n, e in self.failed_nodes.items()},
            "unresolved": [dict(u) for u in self.unresolved],
            "verdict": None if self.verdict is None else self.verdict.to_json(),
            "done": self.done,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BisectionState:
        version = data.get("version")
        if version != STATE_VERSION:
            raise ValueError(f"bisection state version {version!r}, expected {STATE_VERSION}")
        verdict = data.get("verdict")
        return cls(
            nodes=[str(n) for n in data["nodes"]],
            benchmark=str(data["benchmark"]),
            threshold=float(data["threshold"]),
            higher_is_better=bool(data["higher_is_better"]),
            peers_required=bool(data["peers_required"]),
            reference=None if data.get("reference") is None else float(data["reference"]),
            baseline=None if data.get("baseline") is None else float(data["baseline"]),
            rounds=[BisectionRound.from_json(r) for r in data.get("rounds", [])],
            suspects={str(n) for n in data.get("suspects", [])},
            cleared={str(n) for n in data.get("cleared", [])},
            waiting=[
                {"subjects": [str(n) for n in w["subjects"]], "parent": w.get("parent")}
                for w in data.get("waiting", [])
            ],
            slow_nodes={str(n): dict(e) for n, e in data.get("slow_nodes", {}).items()},
            failed_nodes={str(n): dict(e) for n, e in data.get("failed_nodes", {}).items()},
            unresolved=[dict(u) for u in data.get("unresolved", [])],
            verdict=None if verdict is None else BisectionVerdict.from_json(verdict),
            done=bool(data.get("done", False)),
        )


def _split(items: Sequence[str], parts: int) -> list[list[str]]:
    """Split into ``parts`` contiguous chunks whose sizes differ by at most one."""
    size, extra = divmod(len(items), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


def _halves(subjects: Sequence[str]) -> list[list[str]]:
    mid = math.ceil(len(subjects) / 2)
    return [list(subjects[:mid]), list(subjects[mid:])]


def start(
    nodes: Sequence[str],
    benchmark: str,
    threshold: float,
    higher_is_better: bool = True,
    *,
    baseline: float | None = None,
    baseline_groups: int = DEFAULT_BASELINE_GROUPS,
    peers_required: bool | None = None,
) -> BisectionState:
    """Begin a bisection over ``nodes``: round 0 measures the baseline groups.

    ``threshold`` is the fraction by which a group's figure may be worse than
    the baseline before the group counts as slow. ``baseline`` is an optional
    trusted figure of a healthy group; without it the median of the round-0
    groups is used. ``peers_required`` defaults from the benchmark name (rings
    and NCCL collectives need two nodes in a group).
    """
    if not 0 < threshold < 1:
        raise ValueError(f"threshold must be a fraction in (0, 1), got {threshold}")
    if len(set(nodes)) != len(nodes):
        raise ValueError("nodes must be unique")
    if baseline_groups < 1:
        raise ValueError("baseline_groups must be at least 1")
    if baseline is not None and not (math.isfinite(baseline) and baseline > 0):
        raise ValueError(f"baseline must be a positive finite figure, got {baseline}")
    peers = needs_peers(benchmark) if peers_required is None else peers_required
    state = BisectionState(
        nodes=list(nodes),
        benchmark=benchmark,
        threshold=float(threshold),
        higher_is_better=higher_is_better,
        peers_required=peers,
        reference=None if baseline is None else float(baseline),
    )
    min_members = 2 if peers else 1
    parts = min(baseline_groups, len(nodes) // min_members)
    if parts < 1:
        _finish(state, f"{benchmark} needs at least {min_members} node(s); got {len(nodes)}")
        return state
    if baseline is None and parts < MIN_BASELINE_GROUPS:
        _finish(
            state,
            f"only {parts} baseline group(s) of {len(nodes)} node(s) fit; a robust median needs "
            f"{MIN_BASELINE_GROUPS}: pass a known healthy figure as baseline",
        )
        return state
    groups = [
        BisectionGroup(id=f"r0g{i}", members=chunk, subjects=list(chunk))
        for i, chunk in enumerate(_split(list(nodes), parts))
    ]
    state.rounds.append(BisectionRound(index=0, kind="baseline", groups=groups))
    return state


def next_groups(state: BisectionState) -> list[list[str]]:
    """The groups to run now (each a list of member nodes, in ring order)."""
    if state.done or state.current_round is None:
        return []
    return [list(g.members) for g in state.current_round.groups if g.status == "pending"]


def _estimate_baseline(
    figures: Sequence[float], threshold: float, higher_is_better: bool
) -> float | None:
    """The healthy figure: the median of the best cluster that two groups agree on."""
    ordered = sorted(figures, reverse=higher_is_better)
    for best in ordered:
        if higher_is_better:
            cluster = [f for f in ordered if best * (1 - threshold) <= f <= best]
        else:
            cluster = [f for f in ordered if best <= f <= best * (1 + threshold)]
        if len(cluster) >= 2:
            return float(statistics.median(cluster))
    return None


def _far_better(state: BisectionState, figure: float) -> bool:
    assert state.baseline is not None
    if state.higher_is_better:
        return figure > state.baseline * (1 + state.threshold)
    return figure < state.baseline * (1 - state.threshold)


def _judge(state: BisectionState, figure: float) -> GroupStatus:
    assert state.baseline is not None
    if state.higher_is_better:
        slow = figure < state.baseline * (1 - state.threshold)
    else:
        slow = figure > state.baseline * (1 + state.threshold)
    return "slow" if slow else "ok"


def record(state: BisectionState, group: Sequence[str], figure: float | None) -> BisectionState:
    """Store the figure of one group of the current round; ``None`` means it failed.

    Recording the same answer twice is harmless (a retried request); a
    different answer for a group already recorded is refused.
    """
    current = state.current_round
    if state.done or current is None:
        raise ValueError("the bisection is finished")
    key = frozenset(group)
    match = next((g for g in current.groups if frozenset(g.members) == key), None)
    if match is None:
        raise ValueError(f"group {sorted(key)} is not part of round {current.index}")
    if figure is not None:
        figure = float(figure)
        if not math.isfinite(figure) or figure < 0:
            raise ValueError(f"figure must be a finite non-negative number, got {figure}")
    if match.status != "pending":
        if match.figure == figure:
            return state
        raise ValueError(f"group {match.id} already recorded ({match.status}, {match.figure})")
    match.figure = figure
    if figure is None:
        match.status = "failed"
    elif state.baseline is None:
        match.status = "measured"  # judged once the whole baseline round is in
    else:
        match.status = _judge(state, figure)
    return state


def expire_round(state: BisectionState) -> BisectionState:
    """The deadline passed: every group still pending in the current round failed."""
    current = state.current_round
    if not state.done and current is not None:
        for g in current.groups:
            if g.status == "pending":
                g.status = "failed"
    return state


def _ratio(state: BisectionState, figure: float | None) -> float | None:
    if figure is None or not state.baseline:
        return None
    return round(figure / state.baseline, 4)


def advance(state: BisectionState) -> bool:
    """When the current round is complete, judge it and start the next one (or finish).

    Every slow or failed group of more than one subject is halved and both
    halves are tested in the next round, so several slow nodes are all found.
    Returns False while the current round still waits for answers.
    """
    current = state.current_round
    if state.done or current is None or not current.complete:
        return False
    if current.kind == "baseline" and state.baseline is None:
        measured = [g.figure for g in current.groups if g.status == "measured"]
        if state.reference is not None:
            state.baseline = state.reference
        elif len(measured) < MIN_BASELINE_GROUPS:
            failed = [n for g in current.groups if g.status == "failed" for n in g.subjects]
            if failed:
                state.unresolved.append({"nodes": failed, "reason": "baseline group failed"})
            _finish(
                state,
                f"only {len(measured)} of {len(current.groups)} baseline groups answered; "
                f"a robust baseline needs {MIN_BASELINE_GROUPS}",
            )
            return True
        else:
            state.baseline = _estimate_baseline(
                [f for f in measured if f is not None], state.threshold, state.higher_is_better
            )
            if state.baseline is None:
                _finish(
                    state,
                    "no two baseline groups agree within the threshold: the healthy figure is "
                    "unknown; pass a known healthy figure as baseline",
                )
                return True
        for g in current.groups:
            if g.status == "measured" and g.figure is not None:
                g.status = _judge(state, g.figure)
                if _far_better(state, g.figure):
                    # Either a glitch, or most groups are slow and the baseline is too low.
                    state.unresolved.append(
                        {
                            "nodes": list(g.subjects),
                            "group": g.id,
                            "figure": g.figure,
                            "ratio": _ratio(state, g.figure),
                            "reason": "baseline group far better than the baseline: a glitch, "
                            "or most groups are slow and the baseline is too low",
                        }
                    )

    for g in current.groups:
        if g.status == "ok":
            state.cleared.update(g.subjects)
        elif len(g.subjects) == 1:
            node = g.subjects[0]
            evidence = {"round": current.index, "group": g.id, "members": list(g.members)}
            if g.status == "slow":
                evidence |= {"figure": g.figure, "ratio": _ratio(state, g.figure)}
                state.slow_nodes[node] = evidence
            else:
                state.failed_nodes[node] = evidence
        else:
            for half in _halves(g.subjects):
                state.waiting.append({"subjects": half, "parent": g.id})

    _schedule(state, current.index + 1)
    _update_suspects(state)
    if state.current_round is current:
        _finish(state)
    return True


def _schedule(state: BisectionState, index: int) -> None:
    partners = [n for n in state.nodes if n in state.cleared]
    busy: set[str] = set()
    groups: list[BisectionGroup] = []
    deferred: list[dict[str, Any]] = []
    for entry in state.waiting:
        subjects = list(entry["subjects"])
        members = list(subjects)
        if state.peers_required and len(subjects) == 1:
            partner = next((p for p in partners if p not in busy), None)
            if partner is None:
                if partners:
                    deferred.append(entry)  # every good node is busy this round
                else:
                    state.unresolved.append(
                        {"nodes": list(subjects), "reason": "no known-good node to pair with"}
                    )
                continue
            busy.add(partner)
            members.append(partner)
        groups.append(
            BisectionGroup(
                id=f"r{index}g{len(groups)}",
                members=members,
                subjects=list(subjects),
                parent=entry["parent"],
            )
        )
    state.waiting = deferred
    if groups:
        state.rounds.append(BisectionRound(index=index, kind="bisect", groups=groups))


def _update_suspects(state: BisectionState) -> None:
    suspects = set(state.slow_nodes) | set(state.failed_nodes)
    for entry in state.waiting:
        suspects.update(entry["subjects"])
    current = state.current_round
    if current is not None:
        for g in current.groups:
            if g.status != "ok":
                suspects.update(g.subjects)
    state.suspects = suspects - state.cleared


def _find_unexplained(state: BisectionState) -> None:
    """Slow groups whose halves all came back fine: the slowness is between them or passing."""
    children: dict[str, list[BisectionGroup]] = {}
    for r in state.rounds:
        for g in r.groups:
            if g.parent is not None:
                children.setdefault(g.parent, []).append(g)
    for r in state.rounds:
        for g in r.groups:
            kids = children.get(g.id, [])
            if g.status == "slow" and kids and all(k.status == "ok" for k in kids):
                state.unresolved.append(
                    {
                        "nodes": list(g.subjects),
                        "group": g.id,
                        "figure": g.figure,
                        "ratio": _ratio(state, g.figure),
                        "reason": "group was slow but each half was within threshold: a link "
                        "between the halves, contention, or an intermittent fault",
                    }
                )


def _finish(state: BisectionState, reason: str | None = None) -> None:
    _find_unexplained(state)
    state.done = True
    state.waiting = []
    state.suspects = set(state.slow_nodes) | set(state.failed_nodes)
    slow = dict(sorted(state.slow_nodes.items()))
    failed = dict(sorted(state.failed_nodes.items()))
    parts = []
    if slow:
        parts.append(
            "slow: " + ", ".join(f"{n} ({e.get('ratio')} of baseline)" for n, e in slow.items())
        )
    if failed:
        parts.append("did not answer before the deadline (suspect): " + ", ".join(failed))
    if state.unresolved:
        parts.append(
            "unresolved: "
            + "; ".join(f"{','.join(u['nodes'])}: {u['reason']}" for u in state.unresolved)
        )
    outcome: Outcome
    if reason is not None:
        outcome = "inconclusive"
        parts.insert(0, reason)
    elif slow:
        outcome = "slow"
    elif failed:
        outcome = "failed"
    elif state.unresolved:
        outcome = "inconclusive"
    else:
        outcome = "healthy"
        parts.append(f"every group within {state.threshold:.0%} of the baseline {state.baseline:g}")
    state.verdict = BisectionVerdict(
        outcome=outcome,
        slow_nodes=slow,
        failed_nodes=failed,
        unresolved=[dict(u) for u in state.unresolved],
        reason="; ".join(parts),
    )


def simulate(
    fleet: Mapping[str, float],
    benchmark: str,
    threshold: float,
    fail_nodes: Iterable[str] = (),
    *,
    higher_is_better: bool = True,
    baseline: float | None = None,
    baseline_groups: int = DEFAULT_BASELINE_GROUPS,
) -> BisectionState:
    """Run a whole bisection against a simulated fleet of ``node -> figure``.

    A group's figure is its worst member's (the slowest hop of a ring touches
    the slowest node); a group holding a node of ``fail_nodes`` never answers.
    """
    silent = set(fail_nodes)
    state = start(
        list(fleet),
        benchmark,
        threshold,
        higher_is_better,
        baseline=baseline,
        baseline_groups=baseline_groups,
    )
    # Each round halves something, so this bound is never reached by a sound run.
    for _ in range(4 * len(fleet) + 8):
        if state.done:
            break
        for members in next_groups(state):
            figures = [None if n in silent else fleet[n] for n in members]
            record(state, members, group_figure(figures, higher_is_better))
        advance(state)
    return state
