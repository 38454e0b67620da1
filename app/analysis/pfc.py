"""PFC storm detection and PFC deadlock cycles. Pure: no database, no I/O.

A PFC storm is a port that keeps sending pause frames: a NIC whose receive
path is stuck (a hung host, a firmware fault) pauses its switch port without
end, the switch's buffers fill, and the pauses spread upstream until traffic
on that priority stops fabric-wide. Switches guard against it with a PFC
watchdog (SONiC ``pfcwd``: a queue paused for ``detection_time``, 200 ms by
default, polled every 100-200 ms, is declared stormed; it is restored after
``restoration_time`` without pauses). We see per-second counter rates from
the hosts, so the same idea runs at one-second grain:

* a port (node, iface, priority) is **in storm** once its tx pause rate is at
  least ``threshold_pps`` frames/s, or its tx paused time is at least
  ``threshold_fraction`` of each second, for ``detection_window_s``
  consecutive seconds;
* it is **restored** after ``restoration_window_s`` consecutive seconds below
  both thresholds;
* its **victims** are the other ports whose rx pause rate on the same priority
  rose during the storm: they are the ones being paused.

Inputs are ``PfcSample`` rows, one per port per second, usually built from
the agents' ``NicCounter`` rows with ``samples_from_counter_rates``. A rate of
None (first reading, counter reset after a driver reload) is no information:
it neither extends, breaks nor ends a streak. Negative or impossible rates are
treated the same way, so a reset can never pass for a spike.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

# 400GbE at minimum frame size is ~595 Mpps; a pause rate above that is a bad counter.
MAX_PLAUSIBLE_PPS = 6e8
MICROS_PER_SECOND = 1e6


@dataclass(frozen=True)
class PfcStormConfig:
    """Thresholds and windows, after SONiC's PFC watchdog, at one-second grain."""

    threshold_pps: float = 500.0  # tx pause frames per second on one priority
    threshold_fraction: float = 0.5  # tx paused microseconds per second / 1e6
    detection_window_s: float = 2.0  # consecutive seconds over threshold before a storm
    restoration_window_s: float = 3.0  # consecutive seconds under threshold before restored
    victim_min_rx_pps: float = 10.0  # a victim receives at least this many pauses/s...
    victim_rise_factor: float = 2.0  # ...and at least this many times its rate before
    max_gap_s: float = 3.0  # samples further apart than this break a streak
    sample_period_s: float = 1.0  # assumed span of the first sample of a port
    history_s: float = 300.0  # how much per-port history is kept for evidence and victims


PortKey = tuple[str, str, int | None]  # (node, iface, priority); priority None = link level


@dataclass(frozen=True)
class PfcSample:
    """Pause rates of one port (node, iface, priority) over the second ending at ``ts``.

    Any rate may be None: unknown this second (first reading, counter reset,
    the driver has no such counter).
    """

    node: str
    iface: str
    priority: int | None
    ts: datetime
    tx_pause_rate: float | None = None  # pause frames sent per second
    rx_pause_rate: float | None = None  # pause frames received per second
    tx_pause_duration_rate: float | None = None  # microseconds of pause sent, per second
    rx_pause_duration_rate: float | None = None  # microseconds paused, per second

    @property
    def port(self) -> PortKey:
        return (self.node, self.iface, self.priority)


@dataclass(frozen=True)
class Victim:
    """A port being paused during a storm: its rx pause rate rose."""

    node: str
    iface: str
    priority: int | None
    rx_pause_rate: float  # mean over the storm so far, frames/s
    baseline_rx_pause_rate: float  # mean over the same span before the storm


@dataclass(frozen=True)
class StormFinding:
    """One port in PFC storm, or one that has just been restored."""

    node: str
    iface: str
    priority: int | None
    state: Literal["storm", "restored"]
    first_seen: datetime  # start of the first over-threshold second
    detected_at: datetime  # when the detection window was met
    last_seen: datetime  # end of the last over-threshold second
    restored_at: datetime | None
    victims: tuple[Victim, ...]
    evidence: dict[str, Any]

    @property
    def source(self) -> PortKey:
        return (self.node, self.iface, self.priority)


@dataclass
class _PortState:
    history: deque[PfcSample] = field(default_factory=deque)
    pending: list[PfcSample] = field(default_factory=list)
    processed_ts: datetime | None = None  # newest sample taken in
    last_ts: datetime | None = None  # newest sample that said anything about tx pauses
    streak_start: datetime | None = None
    last_over: datetime | None = None
    calm_since: datetime | None = None
    in_storm: bool = False
    first_seen: datetime | None = None
    detected_at: datetime | None = None
    restored_at: datetime | None = None
    reported_restored: bool = True
    peak_tx_pps: float = 0.0
    peak_fraction: float = 0.0


class PfcStormDetector:
    """Finds ports in PFC storm from per-second pause rates; see the module text."""

    def __init__(self, config: PfcStormConfig | None = None) -> None:
        self.config = config or PfcStormConfig()
        self._ports: dict[PortKey, _PortState] = {}

    def observe(self, sample: PfcSample) -> None:
        """Queue one sample; it is taken into account by the next ``evaluate``."""
        self._ports.setdefault(sample.port, _PortState()).pending.append(sample)

    def observe_many(self, samples: Iterable[PfcSample]) -> None:
        for sample in samples:
            self.observe(sample)

    def evaluate(self, now: datetime) -> list[StormFinding]:
        """Ports in storm now, plus ports restored since the previous call (reported once).

        Samples are processed per port in time order; one older than what that
        port already processed is dropped (late duplicates change nothing).
        """
        for state in self._ports.values():
            self._advance(state)
        findings: list[StormFinding] = []
        for port, state in sorted(self._ports.items(), key=lambda kv: _sort_key(kv[0])):
            self._trim(state, now)
            if state.in_storm:
                findings.append(self._finding(port, state, "storm"))
            elif not state.reported_restored:
                findings.append(self._finding(port, state, "restored"))
                state.reported_restored = True
        return findings

    # -- per-port state machine ------------------------------------------------------

    def _advance(self, state: _PortState) -> None:
        cfg = self.config
        pending, state.pending = sorted(state.pending, key=lambda s: s.ts), []
        for sample in pending:
            if state.processed_ts is not None and sample.ts <= state.processed_ts:
                continue
            state.processed_ts = sample.ts
            state.history.append(sample)  # rx rates too: they make victims
            over = self._over_threshold(sample)
            if over is None:
                continue  # nothing known of tx pauses this second: no effect on any streak
            gap = (
                (sample.ts - state.last_ts).total_seconds() if state.last_ts is not None else None
            )
            interval_start = (
                state.last_ts
                if gap is not None and gap <= cfg.max_gap_s
                else sample.ts - timedelta(seconds=cfg.sample_period_s)
            )
            broken = gap is not None and gap > cfg.max_gap_s
            state.last_ts = sample.ts

            if over:
                if state.streak_start is None or broken:
                    state.streak_start = interval_start
                    if not state.in_storm:
                        state.peak_tx_pps = 0.0
                        state.peak_fraction = 0.0
                state.last_over = sample.ts
                state.calm_since = None
                state.peak_tx_pps = max(state.peak_tx_pps, sample.tx_pause_rate or 0.0)
                state.peak_fraction = max(state.peak_fraction, _fraction(sample) or 0.0)
                span = (sample.ts - state.streak_start).total_seconds()
                if not state.in_storm and span >= cfg.detection_window_s - 1e-9:
                    state.in_storm = True
                    state.first_seen = state.streak_start
                    state.detected_at = sample.ts
                    state.restored_at = None
            else:
                state.streak_start = None
                if state.in_storm:
                    if state.calm_since is None or broken:
                        state.calm_since = interval_start
                    calm = (sample.ts - state.calm_since).total_seconds()
                    if calm >= cfg.restoration_window_s - 1e-9:
                        state.in_storm = False
                        state.restored_at = sample.ts
                        state.reported_restored = False

    def _over_threshold(self, sample: PfcSample) -> bool | None:
        """True/False when the sample says anything about tx pauses, None when it does not."""
        pps = _plausible(sample.tx_pause_rate, MAX_PLAUSIBLE_PPS)
        fraction = _fraction(sample)
        if pps is None and fraction is None:
            return None
        return (pps is not None and pps >= self.config.threshold_pps) or (
            fraction is not None and fraction >= self.config.threshold_fraction
        )

    def _trim(self, state: _PortState, now: datetime) -> None:
        horizon = now - timedelta(seconds=self.config.history_s)
        while state.history and state.history[0].ts < horizon:
            state.history.popleft()

    # -- findings --------------------------------------------------------------------

    def _finding(
        self, port: PortKey, state: _PortState, kind: Literal["storm", "restored"]
    ) -> StormFinding:
        assert state.first_seen is not None and state.detected_at is not None
        last_seen = state.last_over or state.detected_at
        end = state.restored_at or state.last_ts or last_seen
        window = [s for s in state.history if state.first_seen < s.ts <= last_seen]
        tx_rates = [r for s in window if (r := _plausible(s.tx_pause_rate, MAX_PLAUSIBLE_PPS))
                    is not None]
        fractions = [f for s in window if (f := _fraction(s)) is not None]
        evidence: dict[str, Any] = {
            "threshold_pps": self.config.threshold_pps,
            "threshold_fraction": self.config.threshold_fraction,
            "detection_window_s": self.config.detection_window_s,
            "restoration_window_s": self.config.restoration_window_s,
            "duration_s": (last_seen - state.first_seen).total_seconds(),
            "peak_tx_pause_pps": state.peak_tx_pps,
            "mean_tx_pause_pps": sum(tx_rates) / len(tx_rates) if tx_rates else None,
            "peak_paused_fraction": state.peak_fraction,
            "mean_paused_fraction": sum(fractions) / len(fractions) if fractions else None,
            "samples": [
                {
                    "ts": s.ts.isoformat(),
                    "tx_pause_rate": s.tx_pause_rate,
                    "tx_pause_duration_rate": s.tx_pause_duration_rate,
                    "rx_pause_rate": s.rx_pause_rate,
                }
                for s in window[-30:]
            ],
        }
        victims = self._victims(port, state.first_seen, end)
        return StormFinding(
            node=port[0],
            iface=port[1],
            priority=port[2],
            state=kind,
            first_seen=state.first_seen,
            detected_at=state.detected_at,
            last_seen=last_seen,
            restored_at=state.restored_at if kind == "restored" else None,
            victims=victims,
            evidence=evidence,
        )

    def _victims(self, source: PortKey, start: datetime, end: datetime) -> tuple[Victim, ...]:
        cfg = self.config
        span = max(end - start, timedelta(seconds=cfg.sample_period_s))
        victims = []
        for port, state in self._ports.items():
            if port == source or port[2] != source[2]:
                continue
            during = _mean_rx(state.history, start, end)
            if during is None or during < cfg.victim_min_rx_pps:
                continue
            before = _mean_rx(state.history, start - span, start) or 0.0
            if during < before * cfg.victim_rise_factor:
                continue  # it was paused this much before the storm began
            victims.append(Victim(port[0], port[1], port[2], during, before))
        victims.sort(key=lambda v: (-v.rx_pause_rate, v.node, v.iface))
        return tuple(victims)


def _sort_key(port: PortKey) -> tuple[str, str, int]:
    return (port[0], port[1], -1 if port[2] is None else port[2])


def _plausible(rate: float | None, ceiling: float) -> float | None:
    if rate is None or rate != rate or rate < 0 or rate > ceiling:  # NaN, reset, garbage
        return None
    return rate


def _fraction(sample: PfcSample) -> float | None:
    us = _plausible(sample.tx_pause_duration_rate, MICROS_PER_SECOND * 1.1)
    return None if us is None else min(us / MICROS_PER_SECOND, 1.0)


def _mean_rx(history: Iterable[PfcSample], start: datetime, end: datetime) -> float | None:
    rates = [
        r
        for s in history
        if start < s.ts <= end and (r := _plausible(s.rx_pause_rate, MAX_PLAUSIBLE_PPS)) is not None
    ]
    return sum(rates) / len(rates) if rates else None


# -- from NicCounter rows ------------------------------------------------------------

_PRIO_COUNTER = re.compile(r"^(?P<dir>rx|tx)_prio(?P<p>[0-7])_pause(?P<dur>_duration)?$")
_LINK_COUNTER = re.compile(r"^(?P<dir>rx|tx)_pause(?P<dur>_duration)?$")
_SNIFFER_COUNTER = re.compile(r"^pfc_frames_prio(?P<p>[0-7])$")


def samples_from_counter_rates(
    node: str, iface: str, ts: datetime, rates: Mapping[str, float | None]
) -> list[PfcSample]:
    """PfcSamples from one interface's NicCounter rates at one instant.

    ``rates`` maps counter name to rate (the ``rate`` of the NicCounter rows).
    Understood names: ``{rx,tx}_prio{p}_pause[_duration]`` (per priority),
    ``{rx,tx}_pause[_duration]`` (link level, priority None) and the sniffer's
    ``pfc_frames_prio{p}``, which counts pauses sent by the port at the far
    end of the wire and so counts as that port's tx rate. Other names are
    ignored. One sample per priority mentioned.
    """
    fields: dict[int | None, dict[str, float | None]] = {}
    for name, rate in rates.items():
        priority: int | None
        m = _PRIO_COUNTER.match(name)
        if m:
            priority = int(m["p"])
        elif m := _LINK_COUNTER.match(name):
            priority = None
        elif m := _SNIFFER_COUNTER.match(name):
            fields.setdefault(int(m["p"]), {}).setdefault("tx_pause_rate", rate)
            continue
        else:
            continue
        key = f"{m['dir']}_pause_duration_rate" if m["dur"] else f"{m['dir']}_pause_rate"
        fields.setdefault(priority, {})[key] = rate
    return [
        PfcSample(node=node, iface=iface, priority=p, ts=ts, **values)  # type: ignore[arg-type]
        for p, values in fields.items()
    ]


# -- deadlock cycles -----------------------------------------------------------------


def find_deadlock_cycles(edges: Iterable[tuple[Hashable, Hashable]]) -> list[list[Hashable]]:
    """Cycles in the pause graph: possible PFC deadlocks.

    ``edges`` are (pauser, paused) port pairs: the first port sends pauses that
    stop the second. A cycle (A pauses B, B pauses C, C pauses A) can hold
    every port paused forever with no storm source to blame. Returns one
    cycle per strongly connected group of ports (a self-loop counts), each
    as the list of ports in pause order starting from its smallest member
    (by ``repr``); cycles are sorted.
    """
    graph: dict[Hashable, list[Hashable]] = {}
    for a, b in edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    for targets in graph.values():
        targets.sort(key=repr)

    cycles: list[list[Hashable]] = []
    for component in _strongly_connected(graph):
        members = set(component)
        start = min(component, key=repr)
        if len(component) == 1 and start not in graph[start]:
            continue
        cycle = _cycle_through(graph, members, start)
        if cycle:
            cycles.append(cycle)
    cycles.sort(key=lambda c: [repr(x) for x in c])
    return cycles


def _strongly_connected(graph: dict[Hashable, list[Hashable]]) -> list[list[Hashable]]:
    """Tarjan's algorithm, iterative so a long chain of ports cannot overflow the stack."""
    index: dict[Hashable, int] = {}
    low: dict[Hashable, int] = {}
    on_stack: set[Hashable] = set()
    stack: list[Hashable] = []
    result: list[list[Hashable]] = []
    counter = 0
    for root in sorted(graph, key=repr):
        if root in index:
            continue
        work: list[tuple[Hashable, int]] = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            recurse = False
            targets = graph[node]
            while i < len(targets):
                nxt = targets[i]
                i += 1
                if nxt not in index:
                    work.append((node, i))
                    work.append((nxt, 0))
                    recurse = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if recurse:
                continue
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                result.append(component)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return result


def _cycle_through(
    graph: dict[Hashable, list[Hashable]], members: set[Hashable], start: Hashable
) -> list[Hashable]:
    """A shortest cycle from ``start`` back to itself inside ``members`` (BFS)."""
    parents: dict[Hashable, Hashable] = {}
    queue: deque[Hashable] = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for nxt in graph[node]:
            if nxt not in members:
                continue
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return list(reversed(path))
            if nxt not in seen:
                seen.add(nxt)
                parents[nxt] = node
                queue.append(nxt)
    return []
