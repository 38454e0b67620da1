"""Ping-mesh fault localisation: which node, ToR, uplink or path explains the failing pairs.

Every second the analysis engine sums the last few seconds of probe rows into one
``PairStat`` per (source, destination, flow) and calls ``PingmeshLocalizer.evaluate``.
The localizer

1. sums flows into directed pairs and drops pairs whose source has gone silent: a dead
   node cannot report, so its old rows are neither health nor evidence; what its peers
   saw when probing it is the evidence;
2. marks a pair *lossy* when its loss is too unlikely under a small background loss
   rate (binomial tail), so one lost probe is noise but a lost second is not;
3. explains the lossy pairs greedily, as 007 (NSDI'18) and NetBouncer (NSDI'19) do:
   every lossy pair votes for the components on its path; the component with the
   largest (pairs it explains) x (fraction of the pairs crossing it that fail) wins,
   its pairs are removed, and the vote repeats. A component crossed by many healthy
   pairs scores low, which is what separates an uplink (intra-ToR pairs healthy) from
   its ToR, and a node from the ToR it hangs off. Pairs no shared component explains
   become single-path findings;
4. does the same over pairs whose RTT rose well above their own baseline (an EWMA of
   healthy windows), giving latency findings;
5. keeps findings keyed by kind and top suspect, so the caller can update an open
   incident each second and close it when the key stops appearing. Single-path and
   latency findings must persist for a few seconds first (longer than one window),
   so one burst of loss in one window never opens anything.

Pure code: no database, no I/O.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import lru_cache
from operator import itemgetter
from typing import Any, Literal, NamedTuple

from app.analysis.topology import Component, Topology, pair_component, pinglist_for

FindingKind = Literal[
    "node-unreachable", "tor-down", "uplink-down", "path-loss", "latency-degradation"
]

# Loss findings by the type of the component that explains them. A spine explains the
# cross-ToR pairs of many ToRs at once: it is reported as "uplink-down" with the spine
# as the top suspect, the fabric above the ToRs being what failed.
_LOSS_KIND: dict[str, FindingKind] = {
    "node": "node-unreachable",
    "tor": "tor-down",
    "uplink": "uplink-down",
    "spine": "uplink-down",
    "path": "path-loss",
}

# On equal votes prefer the smaller, more common culprit: a NIC or cable before a switch.
_SPECIFICITY = {"path": 0, "node": 1, "uplink": 2, "tor": 3, "spine": 4}


class PairStat(NamedTuple):
    """One flow (UDP source port) of one directed pair, summed over the last window.

    ``rtt_p50_us`` is the median RTT of the flow's replies in the window (None when
    nothing came back); ``ts_last`` the time of the newest probe row summed in.
    """

    src: str
    dst: str
    flow: int
    sent: int
    received: int
    rtt_p50_us: float | None
    ts_last: datetime


@dataclass(frozen=True)
class LocalizerConfig:
    """Thresholds of the ping-mesh localizer; the defaults suit 1 Hz probes on 4 flows."""

    # The caller sums probe rows over this many seconds before each evaluation.
    window_s: float = 4.0
    # A source whose newest row is this much older than the freshest row anywhere is
    # treated as silent (dead or cut off from the backend): its rows are ignored.
    source_stale_s: float = 2.5
    # Per-probe loss a healthy fabric may show; a pair is lossy when its loss has a
    # binomial tail probability below loss_pvalue under this rate.
    background_loss: float = 0.01
    loss_pvalue: float = 1e-4
    min_lost_probes: int = 2
    # A shared component (node, ToR, uplink, spine) needs this many failing pairs, and
    # at least this fraction of the pairs crossing it failing.
    min_pairs: int = 3
    min_score: float = 0.3
    # Latency: degraded when rtt >= baseline * factor and rtt - baseline >= floor.
    latency_factor: float = 2.0
    latency_floor_us: float = 100.0
    baseline_alpha: float = 0.1
    baseline_min_samples: int = 5
    # Seconds a finding must persist before it is reported. Longer than one window for
    # single-path loss, since one burst stays in window_s consecutive windows.
    fabric_confirm_s: float = 0.0
    path_confirm_s: float = 6.0
    latency_confirm_s: float = 3.0
    max_suspects: int = 5
    max_evidence: int = 64

    def confirm_s(self, kind: FindingKind, suspect_type: str) -> float:
        """Seconds a finding of this kind, naming this type of component, must persist."""
        if suspect_type == "path":  # one pair's evidence, loss or latency alike
            return max(self.path_confirm_s, self.latency_confirm_s)
        if kind == "latency-degradation":
            return self.latency_confirm_s
        return self.fabric_confirm_s


@dataclass(frozen=True)
class Suspect:
    """A component that may be at fault; ``score`` in 0..1, higher is likelier."""

    type: str
    id: str
    score: float


@dataclass(frozen=True)
class PairEvidence:
    """One failing or degraded pair behind a finding, flows summed over the window."""

    src: str
    dst: str
    sent: int
    received: int
    flows: int
    lossy_flows: int
    rtt_p50_us: float | None
    baseline_us: float | None


@dataclass
class Finding:
    """One explained fault. ``key`` (kind and top suspect) is stable across evaluations."""

    key: str
    kind: FindingKind
    suspects: list[Suspect]
    evidence: list[PairEvidence]
    failing_pairs: int  # pairs this finding explains (evidence may be capped)
    healthy_pairs: int  # healthy pairs crossing the top suspect
    first_seen: datetime
    last_seen: datetime

    @property
    def top(self) -> Suspect:
        return self.suspects[0]

    def summary(self) -> str:
        top = self.suspects[0]
        return (
            f"{self.kind}: {top.type} {top.id} (score {top.score:.2f}), "
            f"{self.failing_pairs} failing pairs, {self.healthy_pairs} healthy through it"
        )


@lru_cache(maxsize=65536)
def _binomial_tail(n: int, k: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    log_p, log_q = math.log(p), math.log1p(-p)
    lg_n1 = math.lgamma(n + 1)
    total = 0.0
    for i in range(k, n + 1):
        term = math.exp(
            lg_n1 - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * log_p + (n - i) * log_q
        )
        total += term
        if term < total * 1e-12:  # the tail terms shrink fast once past the mean
            break
    return min(1.0, total)


class _Pair:
    """A directed pair's flows summed, plus its classification for this evaluation."""

    __slots__ = ("src", "dst", "sent", "received", "flows", "lossy_flows", "rtt", "baseline")

    def __init__(self, src: str, dst: str, acc: list[Any]) -> None:
        self.src = src
        self.dst = dst
        self.sent: int = acc[0]
        self.received: int = acc[1]
        self.flows: int = acc[2]
        self.lossy_flows: int = acc[3]
        rtts: list[float] = acc[5:]
        self.rtt: float | None = _median(rtts) if rtts else None
        self.baseline: float | None = None

    def evidence(self) -> PairEvidence:
        return PairEvidence(
            src=self.src,
            dst=self.dst,
            sent=self.sent,
            received=self.received,
            flows=self.flows,
            lossy_flows=self.lossy_flows,
            rtt_p50_us=self.rtt,
            baseline_us=self.baseline,
        )


@dataclass
class _Healthy:
    """The healthy pairs of one evaluation; counted per component only when needed."""

    keys: list[tuple[str, str]] = field(default_factory=list)

    def per_component(self, topology: Topology, tor_of: dict[str, str]) -> Counter[Component]:
        # map/zip/Counter run in C: counting 64k pairs this way costs a few milliseconds.
        srcs = list(map(itemgetter(0), self.keys))
        dsts = list(map(itemgetter(1), self.keys))
        counts: Counter[Component] = Counter()
        per_node = Counter(srcs)
        per_node.update(dsts)
        for node, n in per_node.items():
            counts[("node", node)] = n
        tor = tor_of.__getitem__
        per_tor_pair = Counter(zip(map(tor, srcs), map(tor, dsts), strict=True))
        for (tor_a, tor_b), n in per_tor_pair.items():
            for comp in topology.fabric_between(tor_a, tor_b):
                counts[comp] += n
        return counts


class PingmeshLocalizer:
    """Localises loss and latency faults from ping-mesh pair statistics.

    Stateful: it keeps per-pair RTT baselines and when each finding was first seen,
    so one instance should live as long as the engine's leadership and be called
    about once per second with the latest window.
    """

    def __init__(self, config: LocalizerConfig | None = None) -> None:
        self.config = config or LocalizerConfig()
        # (src, dst) -> [baseline RTT in us, healthy windows folded in]
        self._baselines: dict[tuple[str, str], list[float]] = {}
        self._first_seen: dict[str, datetime] = {}

    def baseline_us(self, src: str, dst: str) -> float | None:
        """The pair's learned RTT baseline, or None before it has warmed up."""
        entry = self._baselines.get((src, dst))
        if entry is None or entry[1] < self.config.baseline_min_samples:
            return None
        return entry[0]

    def evaluate(
        self,
        topology: Topology,
        stats: Iterable[PairStat],
        now: datetime | None = None,
    ) -> list[Finding]:
        """Explain the window's failing and degraded pairs; return the confirmed findings.

        ``now`` defaults to the newest ``ts_last`` in ``stats``.
        """
        # The pass allocates one small list per pair and frees them all, creating no
        # cycles; left on, the collector rescans the caller's whole window of rows
        # several times per pass, which costs more than the pass itself.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._evaluate(topology, stats, now)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _evaluate(
        self, topology: Topology, stats: Iterable[PairStat], now: datetime | None
    ) -> list[Finding]:
        cfg = self.config
        sums = _sum_flows(stats)

        newest_by_src: dict[str, datetime] = {}
        for (src, _dst), acc in sums.items():
            ts = acc[4]
            seen = newest_by_src.get(src)
            if seen is None or ts > seen:
                newest_by_src[src] = ts
        if newest_by_src:
            freshest = max(newest_by_src.values())
        else:
            freshest = now or datetime.now(UTC)
        if now is None:
            now = freshest
        stale_before = freshest - timedelta(seconds=cfg.source_stale_s)
        live_sources = {s for s, ts in newest_by_src.items() if ts >= stale_before}

        tor_of = {node: info.tor for node, info in topology.nodes.items()}
        lossy: list[_Pair] = []
        degraded: list[_Pair] = []
        loss_healthy = _Healthy()
        latency_healthy = _Healthy()
        baselines = self._baselines
        alpha, factor, floor = cfg.baseline_alpha, cfg.latency_factor, cfg.latency_floor_us
        warm = cfg.baseline_min_samples
        min_lost, p0, pmax = cfg.min_lost_probes, cfg.background_loss, cfg.loss_pvalue

        for key, acc in sums.items():
            src, dst = key
            if src not in live_sources or src == dst:
                continue
            tor_src, tor_dst = tor_of.get(src), tor_of.get(dst)
            if tor_src is None or tor_dst is None:
                continue  # not (or no longer) in the topology
            sent, received = acc[0], acc[1]
            if sent <= 0:
                continue
            lost = sent - received
            if lost >= min_lost and _binomial_tail(sent, lost, p0) < pmax:
                pair = _Pair(src, dst, acc)
                pair.baseline = self.baseline_us(src, dst)
                lossy.append(pair)
                continue
            loss_healthy.keys.append(key)

            if len(acc) == 5:
                continue  # no reply carried an RTT
            rtt = acc[5] if len(acc) == 6 else _median(acc[5:])
            entry = baselines.get(key)
            if entry is None:
                baselines[key] = [rtt, 1.0]
                continue
            base = entry[0]
            if entry[1] >= warm and rtt >= base * factor and rtt - base >= floor:
                pair = _Pair(src, dst, acc)
                pair.baseline = base
                degraded.append(pair)
                continue  # a degraded window must not drag the baseline up
            entry[0] = base + alpha * (rtt - base)
            entry[1] += 1
            if entry[1] > warm:
                latency_healthy.keys.append(key)

        # Pairs that left the mesh (pinglist rotation, removed nodes) keep no baseline forever.
        if len(baselines) > 4 * len(sums) + 1024:
            for key in [k for k in baselines if k not in sums]:
                del baselines[key]

        candidates = [
            *self._explain(topology, tor_of, lossy, loss_healthy, latency=False, now=now),
            *self._explain(topology, tor_of, degraded, latency_healthy, latency=True, now=now),
        ]
        return self._confirm(candidates, now)

    # -- explanation ----------------------------------------------------------------------

    def _explain(
        self,
        topology: Topology,
        tor_of: dict[str, str],
        bad: list[_Pair],
        healthy: _Healthy,
        latency: bool,
        now: datetime,
    ) -> list[Finding]:
        if not bad:
            return []
        cfg = self.config
        good = healthy.per_component(topology, tor_of)
        comps_of: list[list[Component]] = []
        members: dict[Component, list[int]] = {}
        bad_total: Counter[Component] = Counter()
        for i, pair in enumerate(bad):
            comps = topology.path(pair.src, pair.dst)
            comps_of.append(comps)
            for comp in comps:
                bad_total[comp] += 1
                members.setdefault(comp, []).append(i)

        def score(comp: Component) -> float:
            if comp[0] == "path":
                return 1.0  # a directed pair is the only pair crossing its own path
            failing = bad_total[comp]
            return failing / (failing + good[comp])

        remaining = set(range(len(bad)))
        left: Counter[Component] = Counter(bad_total)
        findings: list[Finding] = []
        while remaining:
            best: Component | None = None
            best_rank: tuple[float, int, str] | None = None
            for comp, n_left in left.items():
                if n_left < cfg.min_pairs:
                    continue
                s = score(comp)
                gain = n_left * s
                # Better than explaining each pair by its own path, or not worth naming.
                if s < cfg.min_score or gain <= 1.0:
                    continue
                rank = (gain, -_SPECIFICITY[comp[0]], comp[1])
                if best_rank is None or rank > best_rank:
                    best, best_rank = comp, rank
            if best is None:
                break
            explained = [i for i in members[best] if i in remaining]
            for i in explained:
                remaining.discard(i)
                for comp in comps_of[i]:
                    left[comp] -= 1
            findings.append(
                self._finding(best, explained, bad, comps_of, bad_total, good, score, latency, now)
            )

        for i in sorted(remaining, key=lambda j: (bad[j].src, bad[j].dst)):
            path = pair_component(bad[i].src, bad[i].dst)
            findings.append(
                self._finding(path, [i], bad, comps_of, bad_total, good, score, latency, now)
            )
        return findings

    def _finding(
        self,
        comp: Component,
        explained: list[int],
        bad: list[_Pair],
        comps_of: list[list[Component]],
        bad_total: Counter[Component],
        good: Counter[Component],
        score: Any,
        latency: bool,
        now: datetime,
    ) -> Finding:
        cfg = self.config
        # Other components covering these pairs, scored by the share of them they cover
        # times their own failing fraction: what an operator should look at next.
        coverage: Counter[Component] = Counter()
        for i in explained:
            coverage.update(c for c in comps_of[i] if c != comp)
        alternatives = sorted(
            (
                (coverage[c] / len(explained) * score(c), -_SPECIFICITY[c[0]], c)
                for c in coverage
            ),
            reverse=True,
        )
        suspects = [Suspect(comp[0], comp[1], round(score(comp), 4))]
        for alt_score, _spec, c in alternatives[: cfg.max_suspects - 1]:
            if alt_score > 0:
                suspects.append(Suspect(c[0], c[1], round(alt_score, 4)))

        kind: FindingKind = "latency-degradation" if latency else _LOSS_KIND[comp[0]]
        pairs = [bad[i] for i in explained]
        if latency:
            pairs.sort(key=lambda p: -((p.rtt or 0.0) - (p.baseline or 0.0)))
        else:
            pairs.sort(key=lambda p: (p.received / p.sent, p.src, p.dst))
        return Finding(
            key=f"{kind}:{comp[0]}:{comp[1]}",
            kind=kind,
            suspects=suspects,
            evidence=[p.evidence() for p in pairs[: cfg.max_evidence]],
            failing_pairs=len(explained),
            healthy_pairs=0 if comp[0] == "path" else good[comp],
            first_seen=now,
            last_seen=now,
        )

    def _confirm(self, candidates: list[Finding], now: datetime) -> list[Finding]:
        """Carry first_seen over from earlier evaluations; report what has persisted."""
        first_seen: dict[str, datetime] = {}
        confirmed: list[Finding] = []
        for finding in candidates:
            if finding.key in first_seen:
                continue  # the same component named twice (cannot happen; be safe)
            first = self._first_seen.get(finding.key, now)
            first_seen[finding.key] = first
            finding.first_seen = first
            wait = self.config.confirm_s(finding.kind, finding.top.type)
            if (now - first).total_seconds() >= wait:
                confirmed.append(finding)
        # A candidate that vanishes for one evaluation starts over: noise never adds up.
        self._first_seen = first_seen
        return confirmed


def _median(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) * 0.5


def _sum_flows(stats: Iterable[PairStat]) -> dict[tuple[str, str], list[Any]]:
    """(src, dst) -> [sent, received, flows, lossy flows, newest ts, *per-flow RTT p50s]."""
    sums: dict[tuple[str, str], list[Any]] = {}
    get = sums.get
    last_src = last_dst = None
    acc: list[Any] = []
    for src, dst, _flow, sent, received, rtt, ts in stats:
        # Rows usually come grouped by pair (ORDER BY src, dst): skip the dict lookup then.
        if dst != last_dst or src != last_src:
            last_src, last_dst = src, dst
            key = (src, dst)
            found = get(key)
            if found is None:
                # One list per pair, RTTs appended in place: fewer objects to allocate.
                acc = sums[key] = [sent, received, 1, 1 if received < sent else 0, ts]
                if rtt is not None and received > 0:
                    acc.append(rtt)
                continue
            acc = found
        acc[0] += sent
        acc[1] += received
        acc[2] += 1
        if received < sent:
            acc[3] += 1
        if ts > acc[4]:
            acc[4] = ts
        if rtt is not None and received > 0:
            acc.append(rtt)
    return sums


# -- synthetic windows and the benchmark ------------------------------------------------------


def synthetic_window(
    topology: Topology,
    pinglists: dict[str, Sequence[str]],
    now: datetime,
    flows: int = 4,
    probes_per_flow: int = 4,
    rtt_us: float = 30.0,
    lost: Any = None,
    silent: Iterable[str] = (),
    rtt_extra_us: Any = None,
    rng: random.Random | None = None,
    noise_loss: float = 0.0,
) -> list[PairStat]:
    """One window of PairStats as the engine would sum them, for tests and benchmarks.

    ``lost(src, dst, flow) -> bool`` says whether a flow's probes are all lost;
    ``rtt_extra_us(src, dst) -> float`` adds delay; nodes in ``silent`` report nothing;
    ``noise_loss`` drops each probe independently with that probability.
    """
    silent_set = set(silent)
    rows: list[PairStat] = []
    for src, peers in pinglists.items():
        if src in silent_set:
            continue
        for dst in peers:
            extra = rtt_extra_us(src, dst) if rtt_extra_us else 0.0
            for flow in range(flows):
                received = probes_per_flow
                if lost is not None and lost(src, dst, flow):
                    received = 0
                elif noise_loss and rng is not None:
                    received -= sum(rng.random() < noise_loss for _ in range(probes_per_flow))
                jitter = rng.uniform(-2.0, 2.0) if rng is not None else 0.0
                rtt = rtt_us + extra + jitter if received else None
                rows.append(PairStat(src, dst, 49152 + flow, probes_per_flow, received, rtt, now))
    return rows


def benchmark_localizer(
    nodes: int = 1000,
    tors: int = 25,
    peers: int = 64,
    flows: int = 4,
    evaluations: int = 10,
) -> dict[str, Any]:
    """Time ``evaluate`` on a synthetic cluster: healthy windows, then one ToR down.

    Each node probes its whole ToR plus ``peers - (ToR size - 1)`` cross-ToR peers.
    Returns rows per window and the evaluation times in milliseconds.
    """
    topology = Topology.synthetic(nodes, tors)
    per_tor = len(topology.nodes_on(topology.tors[0]))
    cross = max(0, peers - (per_tor - 1))
    pinglists = {n: pinglist_for(topology, n, cross_tor_peers=cross) for n in topology.nodes}
    localizer = PingmeshLocalizer()
    start = datetime(2024, 1, 1, tzinfo=UTC)
    healthy_ms: list[float] = []
    for i in range(evaluations):
        now = start + timedelta(seconds=i)
        window = synthetic_window(topology, pinglists, now, flows=flows)
        t0 = time.perf_counter()
        localizer.evaluate(topology, window, now)
        healthy_ms.append((time.perf_counter() - t0) * 1e3)

    dead_tor = topology.tors[-1]
    on_dead = set(topology.nodes_on(dead_tor))
    now = start + timedelta(seconds=evaluations)
    window = synthetic_window(
        topology,
        pinglists,
        now,
        flows=flows,
        lost=lambda s, d, f: s in on_dead or d in on_dead,
    )
    t0 = time.perf_counter()
    findings = localizer.evaluate(topology, window, now)
    fault_ms = (time.perf_counter() - t0) * 1e3
    return {
        "nodes": nodes,
        "tors": tors,
        "peers": max(len(p) for p in pinglists.values()),
        "flows": flows,
        "rows": len(window),
        "evaluate_ms_median": round(statistics.median(healthy_ms), 1),
        "evaluate_ms_max": round(max(healthy_ms), 1),
        "tor_down_evaluate_ms": round(fault_ms, 1),
        "tor_down_top": findings[0].key if findings else None,
    }
